"""The access log: one line per forwarded request."""

from __future__ import annotations

import logging

from balancer.logs import LOG_FIELDS
from balancer.routing.flow import Ticket
from balancer.serving.proxy import Outcome
from balancer.wire.server import Request

access_log = logging.getLogger("kvlb.access")


def log_access(
    request: Request, route: str, request_id: str, outcome: Outcome, elapsed: float, ttft: float | None,
    ticket: Ticket | None = None,
) -> None:
    """One line per forwarded request: text for people, and the same facts as separate keys
    (`extra`) for the JSON formatter. Token counts appear when the replica reported them."""
    tokens = outcome.tokens
    fields = {
        "request_id": request_id,
        "remote": request.remote,
        "method": request.method,
        "route": route,
        "model": outcome.model,
        "replica": outcome.replica,
        "status": outcome.status,
        "attempts": len(outcome.attempts),
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "duration_ms": round(elapsed * 1000, 1),
        "prompt_tokens": tokens.prompt if tokens is not None else None,
        "cached_tokens": tokens.cached if tokens is not None else None,
        "output_tokens": tokens.output if tokens is not None else None,
        "error": outcome.error or None,
        # Flow control's view: the tenant (its bounded label, never a key) and class.
        "tenant": ticket.label if ticket is not None else None,
        "class": ticket.klass if ticket is not None else None,
        "queued_ms": round(ticket.queued_s * 1000, 1) if ticket is not None else None,
    }
    model = outcome.model
    if not model.isprintable() or " " in model:
        model = ascii(model)  # the client's text: one line, one field
    access_log.info(
        "%s %s %s %d replica=%s model=%s attempts=%d ttft=%s duration=%.1fms "
        "prompt_tokens=%s cached_tokens=%s output_tokens=%s error=%s%s id=%s",
        request.remote, request.method, route, outcome.status, outcome.replica, model or "-",
        len(outcome.attempts), "-" if ttft is None else f"{ttft * 1000:.1f}ms", elapsed * 1000,
        _or_dash(fields["prompt_tokens"]), _or_dash(fields["cached_tokens"]),
        _or_dash(fields["output_tokens"]), outcome.error or "-",
        "" if ticket is None else f" tenant={ticket.label} class={ticket.klass} queued={ticket.queued_s * 1000:.1f}ms",
        request_id,
        extra={LOG_FIELDS: fields},
    )


def _or_dash(value: int | str | None) -> int | str:
    return "-" if value is None else value
