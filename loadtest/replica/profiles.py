"""Timing profiles for the simulated replica.

Each profile turns one engine iteration's batch into a duration, continuous batching with
chunked prefill: an iteration that prefills costs `a + b·P + k·Σ p_i·(c_i + p_i/2)` plus
`d1·D + d2·Σ ctx` for the sequences decoding beside it, a decode-only one `d0 + d1·D +
d2·Σ ctx` (milliseconds; P new prompt tokens, p_i of them for request i on top of c_i already
cached, D decoding sequences with contexts ctx). The coefficients were fitted to measured
kernel timings of each model on each GPU group and hold to about ±15–25 % against a real
engine: enough to rank routing policies, not to promise a latency. A change here changes every
latency the simulator reports. docs/calibration.md gives each profile's sources and its
timings against published measurements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    """One model on one GPU group; times in milliseconds."""

    name: str
    model: str
    a_ms: float  # fixed cost of an iteration that prefills anything
    b_ms_per_token: float
    k_ms_per_token2: float  # attention over the prompt grows with prefix length
    d0_ms: float  # fixed cost of a decode-only iteration
    d1_ms_per_seq: float
    d2_ms_per_ctx_token: float
    kv_capacity_tokens: int
    # Bytes of KV cache one token takes, whole model, bf16: 2 (K and V) x layers x KV heads x
    # head dim x 2 bytes. Only a disaggregated decode replica reads it, to time the transfer
    # of a prompt's KV from the prefill replica.
    kv_bytes_per_token: int

    def iteration_seconds(
        self, prefill_tokens: int, prefill_attention: float, decode_seqs: int, decode_context: int
    ) -> float:
        """Duration of one iteration.

        `prefill_attention` is Σ p_i·(c_i + p_i/2) over the requests prefilled in this
        iteration (p_i new tokens on top of c_i already in the cache); the engine sums it
        because only it knows each chunk's offset.
        """
        if prefill_tokens:
            ms = (
                self.a_ms
                + self.b_ms_per_token * prefill_tokens
                + self.k_ms_per_token2 * prefill_attention
            )
        elif decode_seqs:
            ms = self.d0_ms
        else:
            return 0.0
        ms += self.d1_ms_per_seq * decode_seqs + self.d2_ms_per_ctx_token * decode_context
        return ms / 1000.0

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A lone prefill with no chunking: the iteration formula for one request."""
        return (
            self.a_ms
            + self.b_ms_per_token * new_tokens
            + self.k_ms_per_token2 * new_tokens * (cached_tokens + new_tokens / 2)
        )

    def decode_step_ms(self, batch: int, total_context: int) -> float:
        return self.d0_ms + self.d1_ms_per_seq * batch + self.d2_ms_per_ctx_token * total_context

    def kv_transfer_seconds(self, tokens: int, gbps: float) -> float:
        """Model seconds to copy `tokens` tokens' KV over a link of `gbps` gigabits per second,
        from a prefill server to a decode server."""
        return tokens * self.kv_bytes_per_token * 8 / (gbps * 1e9)


# KV bytes per token: K and V x layers x KV heads x head dim x 2 bytes (bf16).
LLAMA_8B_KV = 2 * 32 * 8 * 128 * 2  # 131,072
LLAMA_70B_KV = 2 * 80 * 8 * 128 * 2  # 327,680
QWEN3_8B_KV = 2 * 36 * 8 * 128 * 2  # 147,456

# fmt: off
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("llama-3.1-8b-h100", "llama-3.1-8b", 5.3, 0.0191, 7.4e-7, 8.3, 0.0090, 4.39e-5, 440_000, LLAMA_8B_KV),
        Profile("llama-3.1-8b-h200", "llama-3.1-8b", 4.0, 0.0210, 1.9e-7, 6.8, 0.0105, 3.04e-5, 890_000, LLAMA_8B_KV),
        Profile("qwen3-8b-h100", "qwen3-8b", 5.4, 0.0195, 8.1e-7, 8.4, 0.0097, 4.93e-5, 390_000, QWEN3_8B_KV),
        Profile("llama-3.1-70b-h100-tp4", "llama-3.1-70b", 11.4, 0.0668, 9.3e-7, 17.6, 0.0403, 2.79e-5, 475_000, LLAMA_70B_KV),
        Profile("llama-3.1-70b-h100-tp8", "llama-3.1-70b", 8.8, 0.0453, 4.2e-7, 11.5, 0.0327, 1.39e-5, 1_380_000, LLAMA_70B_KV),
        Profile("llama-3.1-70b-h200-tp4", "llama-3.1-70b", 5.9, 0.0497, 6e-8, 13.4, 0.0147, 1.95e-5, 1_190_000, LLAMA_70B_KV),
    )
}
# fmt: on

DEFAULT_PROFILE = "llama-3.1-8b-h100"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise ValueError(f"unknown profile {name!r}; known profiles: {known}") from None
