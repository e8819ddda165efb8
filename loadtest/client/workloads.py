"""Workloads for the load generator and the routing simulator: trace readers and generators.

A workload is a list of requests, sorted by arrival time, each of which builds its OpenAI
request body on demand. Prompts are made of whitespace-separated words, because the simulated
replica counts one token per word (loadtest/replica/tokens.py): a request asks for exactly the
prompt tokens its trace or spec says, and text that two requests share is shared token for token.
Every word run starts with a word of its own (such as `h17` for hash id 17) followed by words
drawn from a small vocabulary by a generator seeded with that word, so equal runs are equal and
different runs differ from their first word on.

Spec: `KIND[:PATH][,key=value]...`, for example

    mooncake:loadtest/data/mooncake_synthetic_trace.jsonl,speedup=4,limit=300
    shared-prefix,groups=8,prompts_per_group=16,rate=4

Keys of every kind:
    speedup=1       divide all arrival times (and so every gap) by this factor
    limit=N         keep only the first N requests by arrival time (default: all); a trace is
                    read and checked whole but holds no more than those N in memory
    rate=R          trace kinds: replace the trace's arrival times by Poisson arrivals at R
                    requests/s, keeping the trace's order (default: keep the trace's times)
    seed=0          seed of Poisson arrivals, shuffles, tenant draws and generated text
    model=NAME      the `model` every request names (default: the one the runner was given)

Several specs joined by `;` make one workload of all their requests, by arrival time (a
part that names no seed takes its position, 0, 1, ..., as its seed): for example two models
behind one endpoint,

    multi-turn,model=llama-3.1-8b,rate=2;long-prompt,model=llama-3.1-70b,rate=0.5

mooncake:PATH   Mooncake JSONL trace, one object per line: `timestamp` (ms), `input_length`,
                `output_length` (tokens), `hash_ids` (one id per block of the prompt; equal ids
                at position i mean an equal prefix up to block i). Completions. Block i of the
                prompt is the text of hash_ids[i]; the last block is cut to fit input_length,
                blocks beyond hash_ids get ids private to the request and ids beyond
                input_length are ignored. Arrival = timestamp / 1000, counted from the
                earliest request. Output length 0 asks for 1 token.
    block_size=512      tokens per hash id
    on_error=skip       skip: a malformed line is reported in `warnings` and skipped;
                        fail: it raises WorkloadError naming file:line

bailian:PATH    Qwen-Bailian JSONL trace (alibaba-edu/qwen-bailian-usagetraces-anon): Mooncake's
                fields with `timestamp` in seconds and 16-token blocks, plus `chat_id` and
                `parent_chat_id` (-1 for a conversation's first request). Read as mooncake;
                each request's session is its conversation, `chat-ROOT` by the chat_id of its
                first request. `mooncake:` refuses such a file, whose times it would read as
                milliseconds.
    block_size=16       tokens per hash id
    on_error=skip       as for mooncake

azure:PATH      Azure LLM inference trace CSV with columns `TIMESTAMP` (a datetime such as
                `2023-11-16 18:15:46.6805900`, or seconds), `ContextTokens`, `GeneratedTokens`.
                Completions; every prompt is unique from its first word on. Arrival times are
                relative to the earliest row.
    on_error=skip       as for mooncake

burstgpt:PATH   BurstGPT CSV (`Timestamp` in seconds, `Model`, `Request tokens`, `Response tokens`,
                `Total tokens`, `Log Type`; its third release adds `Session ID`, which becomes
                each request's session). Lengths and arrivals only, as azure: every prompt is
                unique and arrival times count from the earliest row. A row of 0 request
                tokens is skipped; 0 response tokens (a failed request in the files with
                failures) asks for 1. The `Model` column names the models BurstGPT logged
                (ChatGPT, GPT-4), not one a fleet serves, so it is not read.
    on_error=skip       as for mooncake

shared-prefix   SGLang's generated-shared-prefix benchmark: `groups` system prompts, each
                followed by `prompts_per_group` questions; completions, prompt = system + " " +
                question. Requests are shuffled and arrive as a Poisson process.
                Session `group-G`.
    groups=64  prompts_per_group=16  system_tokens=2048  question_tokens=128
    output_tokens=256  rate=4 (requests/s)

multi-turn      Chat sessions of `turns` user turns on a system prompt. Turn k sends the system
                prompt, the k-1 earlier user turns each followed by the exact filler reply the
                simulated replica generates for `output_tokens`, and user turn k, so each turn
                extends the previous one's tokens. Sessions start as a Poisson process; turn k
                of a session is sent k * think_s after its first turn (an open-loop schedule, not
                waiting for replies). Session `session-S`.
    sessions=32  turns=6  system_tokens=1024  user_tokens=128  output_tokens=128
    think_s=5  rate=1 (sessions/s)
    shared_system=false     true: all sessions share one system prompt; false: one each

multi-tenant    `tenants` long system prompts; each request picks a tenant with Zipf popularity
                (tenant T has weight 1 / (T + 1) ** zipf, so tenant 0 is the most popular) and
                asks a question of its own. Requests arrive as a Poisson process.
                Session `tenant-T`.
    tenants=16  zipf=1.1  system_tokens=3000  question_tokens=128  output_tokens=128
    requests=1000  rate=8 (requests/s)
    route=completions       completions: prompt = system + " " + question;
                            chat: a system message and a user message

Poisson arrivals start at 0 s. Token counts (`*_tokens`) are words; a chat prompt costs its
words plus one token per message plus one, as the replica's chat template does.

noisy-neighbour `steady_tenants` tenants (`steady-0`, ...) send `steady_rate` requests/s between
                them for `duration_s`; tenant `noisy` sends `noisy_rate` requests/s from
                `burst_start_s` for `burst_s`. Each tenant has a system prompt of its own and
                each request a question of its own; completions, session = tenant.
    steady_tenants=2  steady_rate=2  noisy_rate=20  burst_start_s=10  burst_s=60
    duration_s=90  system_tokens=256  question_tokens=256  output_tokens=128

interactive-batch  One tenant's interactive traffic (`critical_share` of it class `critical`,
                the rest `standard`: short prompts and answers) beside a batch job (tenant
                `batch-job`, class `batch`: long prompts and answers, `batch_share` of all
                requests), `requests` Poisson arrivals at `rate` requests/s in all.
    requests=1000  rate=8  critical_share=0.3  batch_share=0.5  interactive_tokens=512
    interactive_output=64  batch_tokens=2048  batch_output=256

long-prompt     Unique prompts (no shared prefix) of a length drawn uniformly in words, answers
                likewise: prefill-heavy traffic, the case for prefill/decode disaggregation.
    requests=500  rate=1  min_prompt_tokens=8000  max_prompt_tokens=32000
    min_output_tokens=200  max_output_tokens=500

payloads:PATH   Recorded request bodies sent as they are: aiperf's inputs.json
                (`{"data": [{"payloads": [BODY, ...]}, ...]}`) or JSONL, one body a line;
                chat or completions by the body. Poisson arrivals at `rate` (default 8/s).
    repeat=1            send the whole list this many times over, in order

lora            Fine-tuned models on one base: each request names a LoRA adapter in `model`
                (`prefix` + 0..`adapters`-1, drawn by Zipf popularity) and opens with that
                adapter's own system prompt, then a question of its own; completions.
    adapters=64  zipf=1.0  prefix=adapter-  system_tokens=2000  question_tokens=64
    output_tokens=64  requests=2000  rate=20
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import heapq
import json
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, NamedTuple

from loadtest.replica.tokens import output_text

ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"

# (tag, words): `words` words of text starting with `tag`; the empty tag stands for the filler
# reply the simulated replica generates for that many tokens.
Segment = tuple[str, int]

_VOCAB = tuple(
    "able acid aged also area army away baby back ball band bank base bath bear beat bell belt "
    "bird blow blue boat body bone book boot born boss both bowl bulk burn bush busy call calm "
    "came camp card care case cash cast cell chat chip city club coal coat code cold come cook "
    "cool cope copy core cost crew crop dark data date".split()
)
# One random byte picks a word; 256 / 64 is whole, so every word is equally likely.
_BYTE_WORDS = _VOCAB * (256 // len(_VOCAB))


class WorkloadError(ValueError):
    """Bad spec or bad trace file; message says what and where (file:line)."""


@functools.lru_cache(maxsize=4096)
def _segment_text(salt: str, tag: str, words: int) -> str:
    if not tag:
        return output_text(words)
    rest = words - 1
    if rest <= 0:
        return tag
    # randbytes emits whole 32-bit outputs in order, so asking for a multiple of 4 bytes makes
    # a shorter run of a tag the prefix of a longer one (a trace's cut last block).
    raw = random.Random(f"{salt}/{tag}").randbytes((rest + 3) // 4 * 4)
    return tag + " " + " ".join(map(_BYTE_WORDS.__getitem__, raw[:rest]))


def _text(segments: tuple[Segment, ...], salt: str) -> str:
    return " ".join([_segment_text(salt, tag, words) for tag, words in segments])


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One request of a workload. It keeps a recipe, not its text: payload() builds the body."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session: str | None
    route: str
    # Chat: (role, segments) per message. Completions: one ("", segments) for the prompt.
    _parts: tuple[tuple[str, tuple[Segment, ...]], ...] = field(default=(), repr=False)
    _salt: str = field(default="", repr=False)
    # Flow control: who it is for and its class, sent as x-kvlb-tenant and x-kvlb-priority.
    tenant: str | None = None
    priority: str | None = None
    # The LoRA adapter it runs under: its `model`, as vLLM names adapters.
    adapter: str | None = None
    # The model it names, where its workload says (`model=`); else the runner's.
    model: str | None = None
    # A recorded request body sent as it is (`payloads:FILE`), instead of one built from parts.
    body: Mapping[str, Any] | None = field(default=None, repr=False)

    def payload(self, model: str | None = None, stream: bool = True) -> dict:
        """The OpenAI JSON body for this request, built fresh from its recipe."""
        if self.adapter is not None:
            model = self.adapter
        elif self.model is not None:
            model = self.model
        if self.body is not None:
            recorded = {**self.body, "stream": stream}
            if model is not None:
                recorded["model"] = model
            if stream:
                recorded["stream_options"] = {"include_usage": True}
            else:
                recorded.pop("stream_options", None)
            return recorded
        body: dict[str, Any] = {} if model is None else {"model": model}
        if self.route == ROUTE_CHAT:
            body["messages"] = [
                {"role": role, "content": _text(segments, self._salt)}
                for role, segments in self._parts
            ]
        else:
            body["prompt"] = _text(self._parts[0][1], self._salt)
        body["max_tokens"] = self.output_tokens
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        # vLLM/SGLang extension: a real engine then generates exactly max_tokens, like the replica.
        body["ignore_eos"] = True
        return body


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival time, indexed 0..n-1, and the trace lines that were skipped."""

    spec: str
    description: str
    requests: tuple[WorkRequest, ...]
    seed: int
    warnings: tuple[str, ...]


class _BadRow(Exception):
    pass


def _poisson(rng: random.Random, count: int, rate: float) -> list[float]:
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _collect(
    path: str, rows: Iterable[tuple[int, Any]], parse: Callable[[int, Any], Any],
    on_error: str, limit: int | None = None,
) -> tuple[list[Any], list[str]]:
    """Each row parsed (anything with an `arrival_s`), bad rows skipped or fatal by `on_error`.
    With `limit`, only the `limit` earliest by arrival are kept (the file's order at equal
    times), so a day-long trace read for its first minutes holds no more than those."""
    drafts: list[Any] = []
    warnings: list[str] = []
    kept: list[tuple[float, int, Any]] = []  # a heap of the latest first: (-arrival, -lineno, draft)
    for lineno, row in rows:
        try:
            draft = parse(lineno, row)
        except _BadRow as e:
            if on_error == "fail":
                raise WorkloadError(f"{path}:{lineno}: {e}") from None
            warnings.append(f"{path}:{lineno}: skipped: {e}")
            continue
        if limit is None:
            drafts.append(draft)
        elif len(kept) < limit:
            heapq.heappush(kept, (-draft.arrival_s, -lineno, draft))
        elif (-draft.arrival_s, -lineno) > kept[0][:2]:
            heapq.heapreplace(kept, (-draft.arrival_s, -lineno, draft))
    if limit is not None:
        drafts = [draft for *_, draft in sorted(kept, reverse=True)]
    return drafts, warnings


def _open(path: str, mode: str, **kwargs: Any) -> Any:
    try:
        return open(path, mode, **kwargs)
    except OSError as e:
        raise WorkloadError(f"{path}: cannot open trace: {e.strerror or e}") from None


def _whole(value: Any, key: str, low: int) -> int:
    # bool is an int in Python but never a length.
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _BadRow(f"{key!r} must be a {'positive' if low else 'non-negative'} integer")
    return value


def _read_mooncake(path: str, opts: dict, rng: random.Random) -> tuple[str, list, list]:
    return _read_block_trace(path, opts, bailian=False)


def _read_bailian(path: str, opts: dict, rng: random.Random) -> tuple[str, list, list]:
    return _read_block_trace(path, opts, bailian=True)


# Fields of the Qwen-Bailian schema that Mooncake's has not: a file holding them has its
# timestamps in seconds, which read as milliseconds would replay hours in seconds.
_BAILIAN_FIELDS = ("chat_id", "parent_chat_id")


def _read_block_trace(path: str, opts: dict, *, bailian: bool) -> tuple[str, list, list]:
    block = opts["block_size"]
    # Bailian: chat_id -> the chat_id of its conversation's first request.
    roots: dict[int, int] = {}

    def parse(lineno: int, raw: bytes) -> WorkRequest:
        try:
            record = json.loads(raw)
        except ValueError as e:
            raise _BadRow(f"invalid JSON ({e})") from None
        if not isinstance(record, dict):
            raise _BadRow("expected a JSON object")
        if not bailian and all(key in record for key in _BAILIAN_FIELDS):
            raise WorkloadError(
                f"{path}:{lineno}: a Qwen-Bailian record (chat_id, parent_chat_id: timestamps "
                f"in seconds, 16-token blocks); read the file as bailian:{path}")
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in record:
                raise _BadRow(f"missing {key!r}")
        stamp, ids = record["timestamp"], record["hash_ids"]
        unit = "seconds" if bailian else "milliseconds"
        # type() rather than isinstance(): a bool is an int in Python but never a time or an id.
        if type(stamp) not in (int, float) or not 0 <= stamp < math.inf:
            raise _BadRow(f"'timestamp' must be a non-negative number of {unit}")
        prompt = _whole(record["input_length"], "input_length", 1)
        output = max(1, _whole(record["output_length"], "output_length", 0))
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise _BadRow("'hash_ids' must be a list of non-negative integers")
        session = None
        if bailian:
            chat, parent = record.get("chat_id"), record.get("parent_chat_id")
            if type(chat) is not int or type(parent) is not int:
                raise _BadRow("'chat_id' and 'parent_chat_id' must be integers")
            # A parent the file does not hold (cut by a limit upstream) starts a conversation.
            roots[chat] = root = roots.get(parent, chat) if parent >= 0 else chat
            session = f"chat-{root}"
        return _BlockRow(stamp if bailian else stamp / 1000, lineno, prompt, output, session, ids)

    def build(row: _BlockRow) -> WorkRequest:
        prompt, ids = row.prompt_tokens, row.hash_ids
        # Private ids take a prefix no real id has and the line number no other request has.
        segments = tuple(
            (f"h{ids[b]}" if b < len(ids) else f"p{row.lineno}.{b}", min(block, prompt - b * block))
            for b in range(-(-prompt // block))
        )
        return WorkRequest(0, row.arrival_s, prompt, row.output_tokens, row.session,
                           ROUTE_COMPLETIONS, (("", segments),))

    with _open(path, "rb") as file:
        rows = ((n, raw) for n, raw in enumerate(file, 1) if raw.strip())
        kept, warnings = _collect(path, rows, parse, opts["on_error"], opts["limit"])
    return f"{'bailian' if bailian else 'mooncake'} trace {path}", [build(r) for r in kept], warnings


class _BlockRow(NamedTuple):
    """A block trace's row, checked; its text recipe is built only if the row is kept."""

    arrival_s: float
    lineno: int
    prompt_tokens: int
    output_tokens: int
    session: str | None
    hash_ids: list[int]


def _azure_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        moment = datetime.fromisoformat(text.strip())
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    if not math.isfinite(seconds):
        raise ValueError("not finite")
    return seconds


def _csv_int(row: dict, key: str, low: int) -> int:
    try:
        return _whole(int(row[key]), key, low)
    except (TypeError, ValueError):
        return _whole(None, key, low)


class _CsvSchema(NamedTuple):
    """The columns of a lengths-only CSV trace: its arrival time, prompt and answer lengths,
    and the session each request belongs to, where the trace names one."""

    kind: str
    timestamp: str
    prompt: str
    output: str
    session: str | None = None


_AZURE = _CsvSchema("azure", "TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT = _CsvSchema("burstgpt", "Timestamp", "Request tokens", "Response tokens", "Session ID")


def _read_azure(path: str, opts: dict, rng: random.Random) -> tuple[str, list, list]:
    return _read_csv_trace(path, opts, _AZURE)


def _read_burstgpt(path: str, opts: dict, rng: random.Random) -> tuple[str, list, list]:
    return _read_csv_trace(path, opts, _BURSTGPT)


def _read_csv_trace(path: str, opts: dict, schema: _CsvSchema) -> tuple[str, list, list]:
    def parse(lineno: int, row: dict) -> WorkRequest:
        try:
            stamp = _azure_seconds(row[schema.timestamp] or "")
        except ValueError:
            raise _BadRow(f"bad {schema.timestamp!r} {row[schema.timestamp]!r}") from None
        prompt = _csv_int(row, schema.prompt, 1)
        output = max(1, _csv_int(row, schema.output, 0))
        session = (row.get(schema.session) or None) if schema.session else None
        return WorkRequest(0, stamp, prompt, output, session, ROUTE_COMPLETIONS,
                           (("", ((f"a{lineno}", prompt),)),))

    with _open(path, "r", encoding="utf-8", newline="") as file:
        reader = csv.DictReader(file)
        try:
            required = {schema.timestamp, schema.prompt, schema.output}
            missing = required - set(reader.fieldnames or ())
            if missing:
                raise WorkloadError(f"{path}:1: missing columns {', '.join(sorted(missing))}")
            rows = ((reader.line_num, row) for row in reader)
            drafts, warnings = _collect(path, rows, parse, opts["on_error"], opts["limit"])
        except (csv.Error, UnicodeDecodeError) as e:
            raise WorkloadError(f"{path}:{reader.line_num}: unreadable CSV ({e})") from None
    return f"{schema.kind} trace {path}", drafts, warnings


def _read_payloads(path: str, opts: dict, rng: random.Random) -> tuple[str, list, list]:
    """Recorded OpenAI request bodies: aiperf's `inputs.json` (`{"data": [{"payloads": [...]}]}`)
    or JSONL, one body a line. Sent `repeat` times over, in order, as aiperf cycles its dataset."""
    with _open(path, "rb") as f:
        raw = f.read()
    try:
        whole = json.loads(raw)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and isinstance(whole.get("data"), list):
        bodies = [(i + 1, p) for i, entry in enumerate(whole["data"]) if isinstance(entry, dict)
                  for p in entry.get("payloads", [])]
    else:
        bodies = [(lineno, line) for lineno, line in enumerate(raw.splitlines(), 1) if line.strip()]

    def parse(lineno: int, item: Any) -> WorkRequest:
        if isinstance(item, bytes):
            try:
                item = json.loads(item)
            except ValueError as e:
                raise _BadRow(f"invalid JSON ({e})") from None
        if not isinstance(item, dict) or not ("messages" in item or "prompt" in item):
            raise _BadRow("expected a request body with `messages` or `prompt`")
        chat = "messages" in item
        texts = [m.get("content") for m in item["messages"]] if chat else [item["prompt"]]
        if not all(isinstance(t, str) for t in texts):
            raise _BadRow("only text prompts can be replayed")
        words = sum(len(t.split()) for t in texts) + (len(texts) + 1 if chat else 0)
        output = item.get("max_completion_tokens", item.get("max_tokens", 16))
        output = _whole(output, "max_tokens", 1)
        return WorkRequest(0, 0.0, words, output, None, ROUTE_CHAT if chat else ROUTE_COMPLETIONS,
                           body=MappingProxyType(dict(item)))

    drafts, warnings = _collect(path, bodies, parse, opts["on_error"])
    drafts = drafts * opts["repeat"]
    arrivals = _poisson(rng, len(drafts), opts["rate"] or 8.0)
    drafts = [dataclasses.replace(d, arrival_s=at) for d, at in zip(drafts, arrivals, strict=True)]
    return f"payloads: {len(drafts) // opts['repeat']} recorded bodies x {opts['repeat']}", drafts, warnings


def _shared_prefix(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    system, question, output = o["system_tokens"], o["question_tokens"], o["output_tokens"]
    pairs = [(g, i) for g in range(o["groups"]) for i in range(o["prompts_per_group"])]
    rng.shuffle(pairs)
    drafts = [
        WorkRequest(0, at, system + question, output, f"group-{g}", ROUTE_COMPLETIONS,
                    (("", ((f"sp{g}", system), (f"sp{g}.{i}", question))),), str(o["seed"]))
        for at, (g, i) in zip(_poisson(rng, len(pairs), o["rate"]), pairs, strict=True)
    ]
    what = (f"shared-prefix: {o['groups']} groups x {o['prompts_per_group']} prompts, "
            f"system {system} + question {question} words, output {output}")
    return what, drafts, []


def _multi_turn(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    system, user, output = o["system_tokens"], o["user_tokens"], o["output_tokens"]
    drafts = []
    for s, start in enumerate(_poisson(rng, o["sessions"], o["rate"])):
        messages = [("system", (("mt" if o["shared_system"] else f"mt{s}", system),))]
        for k in range(o["turns"]):
            if k:
                messages.append(("assistant", (("", output),)))
            messages.append(("user", ((f"mt{s}.{k}", user),)))
            words = system + (k + 1) * user + k * output
            drafts.append(WorkRequest(
                0, start + k * o["think_s"], words + len(messages) + 1, output, f"session-{s}",
                ROUTE_CHAT, tuple(messages), str(o["seed"]),
            ))
    what = (f"multi-turn: {o['sessions']} sessions x {o['turns']} turns, system {system} words "
            f"({'shared' if o['shared_system'] else 'per session'}), user {user}, "
            f"output {output}, think {o['think_s']:g} s")
    return what, drafts, []


def _multi_tenant(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    system, question, output = o["system_tokens"], o["question_tokens"], o["output_tokens"]
    count, chat = o["requests"], o["route"] == "chat"
    weights = [1 / (t + 1) ** o["zipf"] for t in range(o["tenants"])]
    tenants = rng.choices(range(o["tenants"]), weights=weights, k=count)
    drafts = []
    for r, (t, at) in enumerate(zip(tenants, _poisson(rng, count, o["rate"]), strict=True)):
        head, tail = (f"tn{t}", system), (f"tn{t}.{r}", question)
        if chat:
            parts, tokens = (("system", (head,)), ("user", (tail,))), system + question + 3
        else:
            parts, tokens = (("", (head, tail)),), system + question
        drafts.append(WorkRequest(0, at, tokens, output, f"tenant-{t}",
                                  ROUTE_CHAT if chat else ROUTE_COMPLETIONS, parts, str(o["seed"])))
    what = (f"multi-tenant: {o['tenants']} tenants (zipf {o['zipf']:g}), system {system} + "
            f"question {question} words, output {output}, {o['route']}")
    return what, drafts, []


def _noisy_neighbour(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    system, question, output = o["system_tokens"], o["question_tokens"], o["output_tokens"]
    streams = [(f"steady-{t}", 0.0, o["duration_s"], o["steady_rate"] / o["steady_tenants"])
               for t in range(o["steady_tenants"])]
    streams.append(("noisy", o["burst_start_s"], o["burst_start_s"] + o["burst_s"], o["noisy_rate"]))
    drafts = []
    for tenant, start, end, rate in streams:
        count = max(1, round((end - start) * rate))
        for r, at in enumerate(_poisson(rng, count, rate)):
            if start + at >= end:
                break
            parts = (("", ((f"nn-{tenant}", system), (f"nn-{tenant}.{r}", question))),)
            drafts.append(WorkRequest(0, start + at, system + question, output, tenant, ROUTE_COMPLETIONS,
                                      parts, str(o["seed"]), tenant=tenant))
    what = (f"noisy-neighbour: {o['steady_tenants']} steady tenants at {o['steady_rate']:g} req/s for "
            f"{o['duration_s']:g} s, a noisy one at {o['noisy_rate']:g} req/s from {o['burst_start_s']:g} s "
            f"for {o['burst_s']:g} s; prompt {system}+{question}, output {output}")
    return what, drafts, []


def _interactive_batch(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    drafts = []
    for r, at in enumerate(_poisson(rng, o["requests"], o["rate"])):
        draw = rng.random()
        if draw < o["batch_share"]:
            tenant, klass, prompt, output = "batch-job", "batch", o["batch_tokens"], o["batch_output"]
        else:
            tenant, prompt, output = "app", o["interactive_tokens"], o["interactive_output"]
            interactive = (draw - o["batch_share"]) / max(1 - o["batch_share"], 1e-9)
            klass = "critical" if interactive < o["critical_share"] else "standard"
        parts = (("", ((f"ib-{tenant}", prompt // 2), (f"ib-{tenant}.{r}", prompt - prompt // 2))),)
        drafts.append(WorkRequest(0, at, prompt, output, tenant, ROUTE_COMPLETIONS, parts, str(o["seed"]),
                                  tenant=tenant, priority=klass))
    what = (f"interactive-batch: {o['requests']} requests at {o['rate']:g} req/s, batch share "
            f"{o['batch_share']:g} ({o['batch_tokens']}+{o['batch_output']} tokens), interactive "
            f"{o['interactive_tokens']}+{o['interactive_output']} of which critical {o['critical_share']:g}")
    return what, drafts, []


def _long_prompt(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    """Unique long prompts (documents to summarize, say) with answers of a few hundred
    tokens: prefill heavy enough to stall every decode batch it joins, which is what
    prefill/decode disaggregation is for."""
    low, high = sorted((o["min_prompt_tokens"], o["max_prompt_tokens"]))
    out_low, out_high = sorted((o["min_output_tokens"], o["max_output_tokens"]))
    drafts = []
    for r, at in enumerate(_poisson(rng, o["requests"], o["rate"])):
        prompt, output = rng.randint(low, high), rng.randint(out_low, out_high)
        drafts.append(WorkRequest(0, at, prompt, output, None, ROUTE_COMPLETIONS,
                                  (("", ((f"lp{r}", prompt),)),), str(o["seed"])))
    what = (f"long-prompt: {o['requests']} unique prompts of {low}-{high} words, output {out_low}-{out_high}, "
            f"{o['rate']:g} req/s")
    return what, drafts, []


def _lora(path: str | None, o: dict, rng: random.Random) -> tuple[str, list, list]:
    """Fine-tuned models behind one base: each request names one of `adapters` LoRA adapters,
    drawn by Zipf popularity, and opens with that adapter's own system prompt."""
    system, question, output = o["system_tokens"], o["question_tokens"], o["output_tokens"]
    count = o["requests"]
    weights = [1 / (a + 1) ** o["zipf"] for a in range(o["adapters"])]
    chosen = rng.choices(range(o["adapters"]), weights=weights, k=count)
    drafts = []
    for r, (a, at) in enumerate(zip(chosen, _poisson(rng, count, o["rate"]), strict=True)):
        parts = (("", ((f"lora{a}", system), (f"lora{a}.{r}", question))),)
        drafts.append(WorkRequest(0, at, system + question, output, None, ROUTE_COMPLETIONS, parts,
                                  str(o["seed"]), adapter=f"{o['prefix']}{a}"))
    what = (f"lora: {o['adapters']} adapters (zipf {o['zipf']:g}), each with a system prompt of "
            f"{system} + question {question} words, output {output}")
    return what, drafts, []


def _integer(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("not an integer") from None
        if value < low:
            raise ValueError(f"must be at least {low}")
        return value
    return parse


def _number(positive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError("not a number") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError("must be a positive number" if positive else "must be >= 0")
        return value
    return parse


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return text
    return parse


def _name(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise ValueError("must be true or false")


def _fraction(text: str) -> float:
    value = _number(False)(text)
    if value > 1:
        raise ValueError("must be between 0 and 1")
    return value


_COUNT, _RATE = _integer(1), _number(True)
_Option = tuple[Callable[[str], Any], Any]
_COMMON: dict[str, _Option] = {
    "speedup": (_RATE, 1.0), "limit": (_COUNT, None), "rate": (_RATE, None),
    "seed": (_integer(0), 0), "model": (_name, None),
}
_ON_ERROR: _Option = (_choice("skip", "fail"), "skip")
_Builder = Callable[[Any, dict, random.Random], tuple[str, list, list]]
_KINDS: dict[str, tuple[_Builder, bool, dict[str, _Option]]] = {
    "mooncake": (_read_mooncake, True, {"block_size": (_COUNT, 512), "on_error": _ON_ERROR}),
    "bailian": (_read_bailian, True, {"block_size": (_COUNT, 16), "on_error": _ON_ERROR}),
    "azure": (_read_azure, True, {"on_error": _ON_ERROR}),
    "burstgpt": (_read_burstgpt, True, {"on_error": _ON_ERROR}),
    "payloads": (_read_payloads, True, {"repeat": (_COUNT, 1), "on_error": _ON_ERROR}),
    "shared-prefix": (_shared_prefix, False, {
        "groups": (_COUNT, 64), "prompts_per_group": (_COUNT, 16),
        "system_tokens": (_COUNT, 2048), "question_tokens": (_COUNT, 128),
        "output_tokens": (_COUNT, 256), "rate": (_RATE, 4.0),
    }),
    "multi-turn": (_multi_turn, False, {
        "sessions": (_COUNT, 32), "turns": (_COUNT, 6), "system_tokens": (_COUNT, 1024),
        "user_tokens": (_COUNT, 128), "output_tokens": (_COUNT, 128),
        "think_s": (_number(False), 5.0), "rate": (_RATE, 1.0),
        "shared_system": (_boolean, False),
    }),
    "multi-tenant": (_multi_tenant, False, {
        "tenants": (_COUNT, 16), "zipf": (_number(False), 1.1),
        "system_tokens": (_COUNT, 3000), "question_tokens": (_COUNT, 128),
        "output_tokens": (_COUNT, 128), "requests": (_COUNT, 1000), "rate": (_RATE, 8.0),
        "route": (_choice("completions", "chat"), "completions"),
    }),
    "noisy-neighbour": (_noisy_neighbour, False, {
        "steady_tenants": (_COUNT, 2), "steady_rate": (_RATE, 2.0), "noisy_rate": (_RATE, 20.0),
        "burst_start_s": (_number(False), 10.0), "burst_s": (_RATE, 60.0), "duration_s": (_RATE, 90.0),
        "system_tokens": (_COUNT, 256), "question_tokens": (_COUNT, 256), "output_tokens": (_COUNT, 128),
    }),
    "lora": (_lora, False, {
        "adapters": (_COUNT, 64), "zipf": (_number(False), 1.0), "prefix": (str, "adapter-"),
        "system_tokens": (_COUNT, 2000), "question_tokens": (_COUNT, 64), "output_tokens": (_COUNT, 64),
        "requests": (_COUNT, 2000), "rate": (_RATE, 20.0),
    }),
    "long-prompt": (_long_prompt, False, {
        "requests": (_COUNT, 500), "rate": (_RATE, 1.0), "min_prompt_tokens": (_COUNT, 8000),
        "max_prompt_tokens": (_COUNT, 32000), "min_output_tokens": (_COUNT, 200), "max_output_tokens": (_COUNT, 500),
    }),
    "interactive-batch": (_interactive_batch, False, {
        "requests": (_COUNT, 1000), "rate": (_RATE, 8.0), "critical_share": (_fraction, 0.3),
        "batch_share": (_fraction, 0.5), "interactive_tokens": (_integer(2), 512),
        "interactive_output": (_COUNT, 64), "batch_tokens": (_integer(2), 2048), "batch_output": (_COUNT, 256),
    }),
}


def _parse_spec(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    head, *items = [part.strip() for part in spec.split(",")]
    name, colon, path = head.partition(":")
    name, path = name.strip(), path.strip()
    if name not in _KINDS:
        raise WorkloadError(
            f"workload {spec!r}: unknown kind {name!r} (one of {', '.join(_KINDS)})")
    _, trace, options = _KINDS[name]
    if trace and not path:
        raise WorkloadError(f"workload {spec!r}: {name} needs a trace file ({name}:PATH)")
    if not trace and colon:
        raise WorkloadError(f"workload {spec!r}: {name} takes no file")
    table = {**_COMMON, **options}
    opts = {key: default for key, (_, default) in table.items()}
    given: set[str] = set()
    for item in items:
        key, equals, value = (s.strip() for s in item.partition("="))
        if not equals or not key:
            raise WorkloadError(f"workload {spec!r}: expected key=value, got {item!r}")
        if key not in table:
            raise WorkloadError(f"workload {spec!r}: unknown key {key!r} for {name} "
                                f"(known: {', '.join(sorted(table))})")
        if key in given:
            raise WorkloadError(f"workload {spec!r}: {key} given twice")
        given.add(key)
        try:
            opts[key] = table[key][0](value)
        except ValueError as e:
            raise WorkloadError(f"workload {spec!r}: {key}={value!r}: {e}") from None
    return name, path if trace else None, opts


def load_workload(spec: str) -> Workload:
    """Build the workload a spec describes (grammar and keys in this module's docstring)."""
    parts = [part.strip() for part in spec.split(";")]
    if len(parts) == 1:
        return _load_one(spec)
    if not all(parts):
        raise WorkloadError(f"workload {spec!r}: an empty spec between ';'")
    # A part that names no seed takes its position: equal seeds would draw equal arrivals.
    loaded = [_load_one(part if n == 0 or _names_seed(part) else f"{part},seed={n}")
              for n, part in enumerate(parts)]
    # Each part keeps its own order at equal times, the earlier part first.
    merged = sorted(((r.arrival_s, n, r.index, r) for n, w in enumerate(loaded) for r in w.requests),
                    key=lambda item: item[:3])
    requests = tuple(dataclasses.replace(r, index=i) for i, (*_, r) in enumerate(merged))
    return Workload(spec, "; ".join(w.description for w in loaded), requests, loaded[0].seed,
                    tuple(warning for w in loaded for warning in w.warnings))


def _names_seed(spec: str) -> bool:
    return any(item.partition("=")[0].strip() == "seed" for item in spec.split(",")[1:])


def _load_one(spec: str) -> Workload:
    name, path, opts = _parse_spec(spec)
    build, trace, _ = _KINDS[name]
    rng = random.Random(opts["seed"])
    what, drafts, warnings = build(path, opts, rng)
    if not drafts:
        why = f" ({len(warnings)} lines skipped, the first {warnings[0]})" if warnings else ""
        raise WorkloadError(f"workload {spec!r}: no requests{why}")
    # sorted() is stable, so requests at the same time keep the file's or generator's order.
    drafts = sorted(drafts, key=lambda d: d.arrival_s)[: opts["limit"]]
    arrivals = [d.arrival_s for d in drafts]
    if trace:
        # A trace's times count from its earliest request: a window cut from the middle of a
        # trace (or epoch timestamps) would otherwise open with hours of nothing, waited out
        # for real in a live run.
        arrivals = [at - arrivals[0] for at in arrivals]
    notes = []
    if trace and opts["rate"] is not None:
        arrivals = _poisson(rng, len(drafts), opts["rate"])
        notes.append(f"Poisson {opts['rate']:g} req/s")
    if opts["speedup"] != 1:
        arrivals = [at / opts["speedup"] for at in arrivals]
        notes.append(f"speed-up {opts['speedup']:g}")
    if warnings:
        notes.append(f"{len(warnings)} lines skipped")
    if opts["model"] is not None:
        notes.append(f"model {opts['model']}")
    requests = tuple(
        dataclasses.replace(d, index=i, arrival_s=at, model=opts["model"])
        for i, (d, at) in enumerate(zip(drafts, arrivals, strict=True))
    )
    description = f"{what}: {len(requests)} requests over {arrivals[-1]:.1f} s"
    return Workload(spec, ", ".join([description, *notes]), requests, opts["seed"],
                    tuple(warnings))
