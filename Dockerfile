# kvlb: one process, config mounted at /etc/kvlb/balancer.yaml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# Dependencies first, from pyproject.toml alone, so code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN python - <<'PY' > /tmp/requirements.txt
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
PY
RUN pip install -r /tmp/requirements.txt

COPY balancer ./balancer
COPY policies ./policies
COPY loadtest ./loadtest
COPY config/container.yaml /etc/kvlb/balancer.yaml
RUN pip install --no-deps . && useradd --system --uid 10001 --no-create-home kvlb

USER kvlb
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"
ENTRYPOINT ["kvlb", "serve", "--config", "/etc/kvlb/balancer.yaml"]
