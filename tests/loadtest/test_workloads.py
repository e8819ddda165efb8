from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loadtest.client import workloads
from loadtest.client.workloads import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    Workload,
    WorkloadError,
    load_workload,
)
from loadtest.replica.tokens import chat_tokens, output_text

# The first 300 requests of the shared trace (tests/data/README.md).
SHARED_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_head300.jsonl"


def words(request: workloads.WorkRequest) -> list[str]:
    body = request.payload()
    if request.route == ROUTE_CHAT:
        return chat_tokens(body["messages"])
    return body["prompt"].split()


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def write_jsonl(path: Path, records: list[dict | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def mooncake(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "trace.jsonl", [
        mooncake(0, 40, 5, [1, 2, 3]),        # 16 + 16 + 8 words
        mooncake(1000, 44, 0, [1, 2, 4]),     # shares blocks 1, 2 with the first
        "",
        mooncake(500, 30, 7, [1, 9]),         # shares block 1 only
        mooncake(2000, 50, 3, [5]),           # needs 4 blocks, has 1 id
        mooncake(3000, 10, 2, [6, 7, 8]),     # more ids than blocks
    ])


def test_mooncake_lengths_order_and_sharing(small_trace: Path) -> None:
    w = load_workload(f"mooncake:{small_trace},block_size=16")
    assert isinstance(w, Workload) and w.warnings == () and w.seed == 0
    reqs = w.requests
    assert [r.index for r in reqs] == list(range(5))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 2.0, 3.0]
    assert [r.prompt_tokens for r in reqs] == [40, 30, 44, 50, 10]
    assert [r.output_tokens for r in reqs] == [5, 7, 1, 3, 2]
    assert all(r.route == ROUTE_COMPLETIONS and r.session is None for r in reqs)
    texts = [words(r) for r in reqs]
    assert [len(t) for t in texts] == [r.prompt_tokens for r in reqs]
    first, one_block, two_blocks = texts[0], texts[1], texts[2]
    assert common_prefix(first, two_blocks) == 32
    assert common_prefix(first, one_block) == 16
    assert first[0] == "h1" and first[16] == "h2" and two_blocks[32] == "h4"
    assert texts[3][0] == "h5" and texts[3][16].startswith("p")
    assert texts[4][0] == "h6" and len(texts[4]) == 10


def test_mooncake_cut_block_is_prefix_of_full_block(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        mooncake(0, 16 + n, 1, [1, 2]) for n in range(1, 17)
    ])
    texts = [words(r) for r in load_workload(f"mooncake:{trace},block_size=16").requests]
    full = texts[-1]
    for t in texts:
        assert t == full[: len(t)]


def test_mooncake_private_blocks_never_collide(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [mooncake(0, 64, 1, [0]), mooncake(0, 64, 1, [0])])
    a, b = (words(r) for r in load_workload(f"mooncake:{trace},block_size=16").requests)
    assert common_prefix(a, b) == 16
    assert not {a[16], a[32], a[48]} & {b[16], b[32], b[48]}


def bailian(chat: int, parent: int, ts: float, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": ts, "input_length": n_in,
            "output_length": n_out, "type": "text", "turn": 1, "hash_ids": ids}


@pytest.fixture
def bailian_trace(tmp_path: Path) -> Path:
    # Two conversations as Qwen-Bailian logs them: times in seconds, 16-token blocks, and each
    # later turn naming the request before it, its prompt carrying the earlier turn's blocks.
    return write_jsonl(tmp_path / "qwen.jsonl", [
        bailian(10, -1, 0.0, 40, 12, [1, 2, 3]),
        bailian(11, -1, 1.5, 20, 5, [7, 8]),
        bailian(12, 10, 61.114, 70, 9, [1, 2, 3, 4, 5]),
        bailian(13, 12, 125.0, 90, 9, [1, 2, 3, 4, 5, 6]),
        bailian(14, 99, 130.0, 16, 1, [9]),  # its parent fell before the file's first line
    ])


def test_bailian_times_are_seconds_and_turns_share_their_conversation(bailian_trace: Path) -> None:
    w = load_workload(f"bailian:{bailian_trace}")
    reqs = w.requests
    assert w.warnings == ()
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 61.114, 125.0, 130.0]
    assert [r.session for r in reqs] == ["chat-10", "chat-11", "chat-10", "chat-10", "chat-14"]
    first, _, second, third, _ = (words(r) for r in reqs)
    # 16-token blocks by default: the second turn holds the first's two whole blocks and
    # the third block's id, cut to 8 words in the first, whole in the second.
    assert common_prefix(first, second) == 40 and second[48] == "h4"
    assert common_prefix(second, third) == 70


def test_a_window_cut_from_the_middle_of_a_trace_starts_at_once(tmp_path: Path) -> None:
    hour = 3_600_000
    trace = write_jsonl(tmp_path / "t.jsonl", [mooncake(hour + 250, 16, 1, [1]), mooncake(hour, 16, 1, [2])])
    assert [r.arrival_s for r in load_workload(f"mooncake:{trace},block_size=16").requests] == [0.0, 0.25]
    qwen = write_jsonl(tmp_path / "q.jsonl", [bailian(5, -1, 7200.5, 16, 1, [1]), bailian(6, 5, 7260.5, 32, 1, [1, 2])])
    assert [r.arrival_s for r in load_workload(f"bailian:{qwen}").requests] == [0.0, 60.0]


def test_a_bailian_trace_read_as_mooncake_is_refused_not_replayed_a_thousand_times_fast(
        bailian_trace: Path) -> None:
    with pytest.raises(WorkloadError, match="bailian:"):
        load_workload(f"mooncake:{bailian_trace},block_size=16")


def test_a_bailian_record_without_its_chat_ids_is_skipped_with_its_line(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "qwen.jsonl", [
        bailian(1, -1, 0.0, 16, 1, [1]),
        {**bailian(2, -1, 1.0, 16, 1, [2]), "chat_id": "two"},
        mooncake(2000, 16, 1, [3]),
    ])
    w = load_workload(f"bailian:{trace}")
    assert len(w.requests) == 1
    assert [warning.split(": ", 1)[0] for warning in w.warnings] == [f"{trace}:2", f"{trace}:3"]
    assert all("chat_id" in warning for warning in w.warnings)


def test_speedup_and_limit(small_trace: Path) -> None:
    w = load_workload(f"mooncake:{small_trace},block_size=16,speedup=4,limit=3")
    assert [r.arrival_s for r in w.requests] == [0.0, 0.125, 0.25]
    assert [r.index for r in w.requests] == [0, 1, 2]
    assert "3 requests" in w.description and "speed-up 4" in w.description


def test_malformed_lines_are_skipped_with_line_numbers(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "bad.jsonl", [
        mooncake(0, 10, 1, [1]),
        "{not json",
        {"timestamp": 0, "output_length": 1, "hash_ids": []},
        mooncake(0, -5, 1, [1]),
        mooncake(0, 10, 1, ["x"]),
        "[1, 2]",
        mooncake(0, 10, 1, [2]),
    ])
    w = load_workload(f"mooncake:{trace}")
    assert len(w.requests) == 2
    where = [x.split(": skipped")[0] for x in w.warnings]
    assert where == [f"{trace}:{n}" for n in (2, 3, 4, 5, 6)]
    assert "invalid JSON" in w.warnings[0]
    assert "missing 'input_length'" in w.warnings[1]
    assert "'input_length' must be a positive integer" in w.warnings[2]
    assert "5 lines skipped" in w.description
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: invalid JSON"):
        load_workload(f"mooncake:{trace},on_error=fail")


@pytest.mark.parametrize("spec, message", [
    ("mooncake:/nonexistent/trace.jsonl", "cannot open"),
    ("mooncake", "needs a trace file"),
    ("nosuch:x", "unknown kind"),
    ("shared-prefix,nosuch=1", "unknown key 'nosuch'"),
    ("shared-prefix,groups=0", "groups='0'"),
    ("shared-prefix,groups=two", "not an integer"),
    ("shared-prefix,rate=-1", "positive number"),
    ("shared-prefix,rate=nan", "positive number"),
    ("shared-prefix,seed=1,seed=2", "twice"),
    ("shared-prefix,groups", "key=value"),
    ("shared-prefix:file", "takes no file"),
    ("multi-turn,shared_system=maybe", "true or false"),
    ("multi-tenant,route=grpc", "one of"),
    ("mooncake:x,on_error=ignore", "one of"),
    ("azure:x,block_size=16", "unknown key"),
])
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(spec)


def test_empty_trace_is_an_error(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "empty.jsonl", ["{}"])
    with pytest.raises(WorkloadError, match="no requests"):
        load_workload(f"mooncake:{trace}")


def test_a_file_with_no_request_says_why_its_lines_were_skipped(tmp_path: Path) -> None:
    trace = tmp_path / "notes.jsonl"
    trace.write_text("# not a trace\nnor this\n")
    with pytest.raises(WorkloadError, match=r"no requests \(2 lines skipped, the first .*notes.jsonl:1: skipped: invalid JSON"):
        load_workload(f"mooncake:{trace}")


def test_shared_trace_prefixes_follow_hash_ids() -> None:
    w = load_workload(f"mooncake:{SHARED_TRACE},limit=200")
    lines = [json.loads(line) for line in SHARED_TRACE.read_text().splitlines()[:400]]
    records = sorted(lines, key=lambda r: r["timestamp"])[:200]
    texts = [words(r) for r in w.requests]
    for r, rec, text in zip(w.requests, records, texts, strict=True):
        assert len(text) == rec["input_length"] == r.prompt_tokens
    for i in range(len(records)):
        for j in range(i):
            a, b = records[i]["hash_ids"], records[j]["hash_ids"]
            shared = common_prefix(a, b)
            expected = min(shared * 512, len(texts[i]), len(texts[j]))
            assert common_prefix(texts[i], texts[j]) == expected


def write_azure(path: Path, rows: list[tuple[str, object, object]]) -> Path:
    body = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    body += "".join(f"{t},{c},{g}\n" for t, c, g in rows)
    path.write_text(body)
    return path


def test_azure_lengths_arrivals_and_no_sharing(tmp_path: Path) -> None:
    trace = write_azure(tmp_path / "azure.csv", [
        ("2023-11-16 18:15:46.6805900", 30, 4),
        ("2023-11-16 18:15:47.1805900", 30, 0),
        ("2023-11-16 18:15:48.6805900", 12, 9),
        ("yesterday", 5, 5),
        ("2023-11-16 18:15:49.0000000", -1, 5),
    ])
    w = load_workload(f"azure:{trace}")
    assert [round(r.arrival_s, 4) for r in w.requests] == [0.0, 0.5, 2.0]
    assert [r.prompt_tokens for r in w.requests] == [30, 30, 12]
    assert [r.output_tokens for r in w.requests] == [4, 1, 9]
    texts = [words(r) for r in w.requests]
    assert [len(t) for t in texts] == [30, 30, 12]
    assert len({t[0] for t in texts}) == 3
    assert [x.split(": skipped")[0] for x in w.warnings] == [f"{trace}:5", f"{trace}:6"]
    with pytest.raises(WorkloadError, match="azure.csv:5"):
        load_workload(f"azure:{trace},on_error=fail")


def test_a_limit_keeps_the_earliest_requests_of_an_unsorted_trace_in_file_order_at_ties(
        tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        mooncake(900, 16, 1, [1]),
        mooncake(100, 16, 1, [2]),
        mooncake(500, 16, 1, [3]),
        mooncake(500, 16, 1, [4]),
        "not json",
        mooncake(500, 16, 1, [5]),
        mooncake(0, 16, 1, [6]),
    ])
    w = load_workload(f"mooncake:{trace},block_size=16,limit=4")
    assert [words(r)[0] for r in w.requests] == ["h6", "h2", "h3", "h4"]
    assert [r.arrival_s for r in w.requests] == [0.0, 0.1, 0.5, 0.5]
    # Every line is still read and checked, kept or not.
    assert [x.split(": skipped")[0] for x in w.warnings] == [f"{trace}:5"]

    azure = write_azure(tmp_path / "azure.csv", [
        ("30.0", 10, 1), ("10.0", 20, 1), ("20.0", 30, 1), ("5.0", 40, 1),
    ])
    w = load_workload(f"azure:{azure},limit=2")
    assert [(r.arrival_s, r.prompt_tokens) for r in w.requests] == [(0.0, 40), (5.0, 20)]


def test_burstgpt_lengths_arrivals_and_sessions(tmp_path: Path) -> None:
    first = tmp_path / "BurstGPT_1.csv"
    first.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,230,1317,Conversation log\n"
        "7,ChatGPT,0,20,20,Conversation log\n"
        "118,GPT-4,417,276,693,Conversation log\n"
        "120,GPT-4,300,0,300,API log\n")
    w = load_workload(f"burstgpt:{first}")
    assert [r.arrival_s for r in w.requests] == [0.0, 40.0, 113.0, 115.0]
    assert [r.prompt_tokens for r in w.requests] == [472, 1087, 417, 300]
    assert [r.output_tokens for r in w.requests] == [18, 230, 276, 1]  # a failed request asks for 1
    assert all(r.session is None for r in w.requests)
    assert len({words(r)[0] for r in w.requests}) == 4  # nothing shared
    assert [x.split(": skipped")[0] for x in w.warnings] == [f"{first}:4"]  # no prompt to send

    third = tmp_path / "BurstGPT_3.csv"
    third.write_text(
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0.5,a1,1.2,ChatGPT,100,20,120,Conversation log\n"
        "2.0,b2,0.8,ChatGPT,50,10,60,Conversation log\n"
        "9.5,a1,1.0,ChatGPT,180,30,210,Conversation log\n")
    w = load_workload(f"burstgpt:{third}")
    assert [(r.arrival_s, r.session) for r in w.requests] == [(0.0, "a1"), (1.5, "b2"), (9.0, "a1")]
    with pytest.raises(WorkloadError, match="missing columns Request tokens"):
        load_workload(f"burstgpt:{write_azure(tmp_path / 'azure.csv', [('1.0', 5, 5)])}")


def test_azure_numeric_timestamps_and_missing_columns(tmp_path: Path) -> None:
    trace = write_azure(tmp_path / "a.csv", [("10.5", 3, 1), ("12", 4, 1)])
    assert [r.arrival_s for r in load_workload(f"azure:{trace},speedup=2").requests] == [0, 0.75]
    bad = tmp_path / "b.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(WorkloadError, match="missing columns GeneratedTokens"):
        load_workload(f"azure:{bad}")


def test_shared_prefix_structure() -> None:
    w = load_workload("shared-prefix,groups=4,prompts_per_group=5,system_tokens=40,"
                      "question_tokens=7,output_tokens=9,rate=50")
    assert len(w.requests) == 20
    by_group: dict[str, list[list[str]]] = {}
    for r in w.requests:
        assert r.route == ROUTE_COMPLETIONS and r.output_tokens == 9 and r.prompt_tokens == 47
        text = words(r)
        assert len(text) == 47
        by_group.setdefault(r.session, []).append(text)
    assert sorted(by_group) == [f"group-{g}" for g in range(4)]
    for texts in by_group.values():
        assert len(texts) == 5
        for a in texts:
            for b in texts:
                if a is not b:
                    assert common_prefix(a, b) == 40
    assert len({texts[0][0] for texts in by_group.values()}) == 4
    assert [r.session for r in w.requests] != sorted(r.session for r in w.requests)


def test_multi_turn_extends_each_turn() -> None:
    spec = ("multi-turn,sessions=3,turns=4,system_tokens=20,user_tokens=5,output_tokens=6,"
            "think_s=2,rate=1")
    w = load_workload(spec)
    assert len(w.requests) == 12
    sessions: dict[str, list] = {}
    for r in w.requests:
        assert r.route == ROUTE_CHAT and r.output_tokens == 6
        sessions.setdefault(r.session, []).append(r)
    assert sorted(sessions) == ["session-0", "session-1", "session-2"]
    systems = set()
    for turns in sessions.values():
        assert [t.arrival_s - turns[0].arrival_s for t in turns] == pytest.approx([0, 2, 4, 6])
        previous: list[str] = []
        for k, r in enumerate(turns):
            messages = r.payload()["messages"]
            tokens = chat_tokens(messages)
            assert r.prompt_tokens == len(tokens)
            assert len(tokens) > len(previous) and tokens[: len(previous)] == previous
            roles = ["system"] + ["user", "assistant"] * k + ["user"]
            assert [m["role"] for m in messages] == roles
            assert all(m["content"] == output_text(6) for m in messages[2::2])
            previous = tokens
        systems.add(turns[0].payload()["messages"][0]["content"])
    assert len(systems) == 3
    shared = load_workload(spec + ",shared_system=true")
    assert len({r.payload()["messages"][0]["content"] for r in shared.requests}) == 1


def test_multi_tenant_sharing_and_zipf() -> None:
    w = load_workload("multi-tenant,tenants=6,zipf=1.2,system_tokens=30,question_tokens=4,"
                      "output_tokens=3,requests=600,rate=100")
    counts = Counter(r.session for r in w.requests)
    assert counts.most_common(1)[0][0] == "tenant-0"
    assert counts["tenant-0"] > counts["tenant-5"]
    systems: dict[str, set[str]] = {}
    questions = set()
    for r in w.requests[:100]:
        text = words(r)
        assert len(text) == r.prompt_tokens == 34
        systems.setdefault(r.session, set()).add(" ".join(text[:30]))
        questions.add(" ".join(text[30:]))
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == len(systems)
    assert len(questions) == 100
    chat = load_workload("multi-tenant,requests=10,system_tokens=30,question_tokens=4,route=chat")
    for r in chat.requests:
        assert r.route == ROUTE_CHAT and r.prompt_tokens == len(words(r)) == 37


@pytest.mark.parametrize("spec", [
    "shared-prefix,groups=3,prompts_per_group=4,system_tokens=50,question_tokens=10",
    "multi-turn,sessions=3,turns=3,system_tokens=50,user_tokens=10,output_tokens=5",
    "multi-tenant,requests=30,system_tokens=50,question_tokens=10",
])
def test_deterministic_and_seeded(spec: str) -> None:
    def dump(w: Workload) -> list[tuple[float, str]]:
        return [(r.arrival_s, json.dumps(r.payload("m"))) for r in w.requests]

    assert dump(load_workload(spec)) == dump(load_workload(spec))
    first = load_workload(spec + ",seed=1")
    assert dump(first) != dump(load_workload(spec + ",seed=2"))
    assert [json.dumps(r.payload()) for r in first.requests] == [
        json.dumps(r.payload()) for r in first.requests
    ]


def test_rate_override_on_a_trace(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "many.jsonl", [mooncake(i, 4, 1, [i]) for i in range(3000)])
    w = load_workload(f"mooncake:{trace},rate=8,seed=3")
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(8, rel=0.1)
    assert [words(r)[0] for r in w.requests[:3]] == ["h0", "h1", "h2"]
    fast = load_workload(f"mooncake:{trace},rate=8,seed=3,speedup=2")
    assert fast.requests[-1].arrival_s == pytest.approx(arrivals[-1] / 2)
    assert "Poisson 8 req/s" in w.description


def test_generator_rate() -> None:
    w = load_workload("multi-tenant,requests=3000,rate=20,system_tokens=5,question_tokens=1")
    assert (len(w.requests) - 1) / w.requests[-1].arrival_s == pytest.approx(20, rel=0.1)


def test_payload_shape(small_trace: Path) -> None:
    r = load_workload(f"mooncake:{small_trace}").requests[0]
    streaming = r.payload("llama")
    assert streaming["model"] == "llama" and streaming["max_tokens"] == 5
    assert streaming["stream"] is True and streaming["stream_options"] == {"include_usage": True}
    assert streaming["ignore_eos"] is True
    plain = r.payload(stream=False)
    assert "model" not in plain and plain["stream"] is False and "stream_options" not in plain
    assert plain["prompt"] == streaming["prompt"]


def test_vocabulary_maps_bytes_uniformly() -> None:
    assert 256 % len(workloads._VOCAB) == 0 and len(set(workloads._VOCAB)) == len(workloads._VOCAB)
    assert len(workloads._BYTE_WORDS) == 256


def test_recorded_bodies_are_replayed_as_they_are(tmp_path):
    import json

    chat = {"model": "theirs", "messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "one two three"}],
            "max_completion_tokens": 7, "ignore_eos": True}
    completion = {"prompt": "four five", "max_tokens": 3}
    aiperf = tmp_path / "inputs.json"
    aiperf.write_text(json.dumps({"data": [{"session_id": "a", "payloads": [chat]},
                                           {"session_id": "b", "payloads": [completion]}]}))
    lines = tmp_path / "bodies.jsonl"
    lines.write_text(json.dumps(chat) + "\n\n" + json.dumps(completion) + "\n{not json\n")
    for path, skipped in ((aiperf, 0), (lines, 1)):
        workload = load_workload(f"payloads:{path},repeat=2,seed=1")
        assert len(workload.warnings) == skipped
        requests = workload.requests
        assert [r.route for r in requests] == ["/v1/chat/completions", "/v1/completions"] * 2
        assert [r.prompt_tokens for r in requests[:2]] == [2 + 3 + 3, 2]  # chat: words, messages, one
        assert [r.output_tokens for r in requests[:2]] == [7, 3]
        body = requests[0].payload("mine", stream=True)
        assert body["messages"] == chat["messages"] and body["model"] == "mine" and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert "stream_options" not in requests[1].payload("mine", stream=False)
        assert all(a.arrival_s <= b.arrival_s for a, b in zip(requests, requests[1:], strict=False))


def test_specs_joined_by_semicolons_make_one_workload_of_several_models():
    small = "multi-turn,model=small,sessions=4,turns=3,rate=2"
    big = "long-prompt,model=big,requests=6,rate=1,min_prompt_tokens=100,max_prompt_tokens=200"
    joined = load_workload(f"{small};{big}")
    alone = [load_workload(small), load_workload(f"{big},seed=1")]
    assert len(joined.requests) == sum(len(w.requests) for w in alone)
    assert [r.index for r in joined.requests] == list(range(len(joined.requests)))
    assert [r.arrival_s for r in joined.requests] == sorted(r.arrival_s for r in joined.requests)
    # Each part keeps its own requests, times and model; the second part drew its own arrivals.
    for part, model in zip(alone, ("small", "big"), strict=True):
        mine = [r for r in joined.requests if r.model == model]
        assert [(r.arrival_s, words(r)) for r in mine] == [(r.arrival_s, words(r)) for r in part.requests]
        assert all(r.payload("default")["model"] == model for r in mine)
    assert load_workload(small).requests[0].payload("default")["model"] == "small"
    assert load_workload("multi-turn,sessions=1").requests[0].payload("default")["model"] == "default"
    for bad in (f"{small};", f"{small};;{big}", "multi-turn,model="):
        with pytest.raises(WorkloadError):
            load_workload(bad)


SHIPPED_DATA = Path(__file__).resolve().parents[2] / "loadtest" / "data"


@pytest.mark.parametrize(("spec", "count", "span_s", "mean_prompt"), [
    ("mooncake:mooncake_synthetic_trace.jsonl", 3993, 1022.0, 15325),
    ("mooncake:mooncake_conversation_trace_head3000.jsonl", 3000, 987.0, 13517),
    ("azure:azure_llm_2023_code_head5000.csv", 5000, 1630.9, 2053),
    ("azure:azure_llm_2023_conv_head5000.csv", 5000, 1023.3, 1161),
])
def test_the_shipped_traces_load_whole_as_their_readme_describes_them(
    spec: str, count: int, span_s: float, mean_prompt: int
) -> None:
    """The docs' held-out results replay these files: a damaged or cut file would change
    every figure, so each must read without a skipped line, at the size its README gives."""
    kind, name = spec.split(":")
    w = load_workload(f"{kind}:{SHIPPED_DATA / name}")
    assert w.warnings == ()
    assert len(w.requests) == count
    assert w.requests[-1].arrival_s - w.requests[0].arrival_s == pytest.approx(span_s, abs=0.1)
    assert sum(r.prompt_tokens for r in w.requests) / count == pytest.approx(mean_prompt, abs=1)
