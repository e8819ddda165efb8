# kvlb's container images. `docker build .` gives the proxy alone (the last stage, `runtime`):
# balancer/ and policies/ with their runtime dependencies, config mounted at
# /etc/kvlb/balancer.yaml. `docker build --target testbed .` adds the test bed (simulated
# replicas, load generator, simulator, comparisons) for running it next to a fleet.
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# Dependencies first, from pyproject.toml alone, so code changes do not reinstall them.
# Precise mode's (the `events` extra) are runtime dependencies of the proxy too.
COPY pyproject.toml README.md ./
RUN python - <<'PY' > /tmp/requirements.txt
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["events"]))
PY
RUN pip install -r /tmp/requirements.txt && useradd --system --uid 10001 --no-create-home kvlb

FROM base AS testbed
RUN python - <<'PY' > /tmp/testbed.txt && pip install -r /tmp/testbed.txt
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["loadtest"]))
PY
COPY balancer ./balancer
COPY policies ./policies
COPY loadtest ./loadtest
RUN pip install --no-deps .
USER kvlb
ENTRYPOINT ["kvlb"]

FROM base AS runtime
COPY balancer ./balancer
COPY policies ./policies
COPY config/container.yaml /etc/kvlb/balancer.yaml
RUN pip install --no-deps .
USER kvlb
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"
ENTRYPOINT ["kvlb", "serve", "--config", "/etc/kvlb/balancer.yaml"]
