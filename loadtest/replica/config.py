"""Settings of one simulated replica, shared by the command line and in-process tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from loadtest.replica.engine import EngineConfig
from loadtest.replica.faults import Faults
from loadtest.replica.kv_events import DEFAULT_TOPIC, ENCODINGS, Encoding
from loadtest.replica.lora import LoraModule
from loadtest.replica.profiles import DEFAULT_PROFILE, get_profile

# SGLang's --disaggregation-mode values; "null" (its default) serves whole requests.
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True, slots=True)
class KvTransferConfig:
    """vLLM's --kv-transfer-config, reduced to what the replica reads."""

    kv_connector: str
    kv_role: str = "kv_both"

    @classmethod
    def parse(cls, text: str) -> KvTransferConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv_transfer_config is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError("kv_transfer_config must be a JSON object")
        connector = data.get("kv_connector")
        if not isinstance(connector, str) or not connector:
            raise ValueError('kv_transfer_config needs "kv_connector", e.g. "NixlConnector"')
        role = data.get("kv_role", "kv_both")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config's kv_role must be one of {', '.join(KV_ROLES)}")
        return cls(connector, role)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    profile: str = DEFAULT_PROFILE
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the server reports the one it got
    model: str | None = None  # None: "kvlb-sim-" + the profile's model
    kv_capacity_tokens: int | None = None  # None: the profile's calibrated capacity
    block_size: int = 16
    max_running: int = 256
    max_batched_tokens: int = 8192
    max_waiting: int = 4096
    context_limit: int = 131072
    default_max_tokens: int = 16
    time_scale: float = 1.0
    # A 131k-word prompt is about 1 MB of JSON; leave room, refuse the absurd.
    max_body_bytes: int = 8 * 1024 * 1024
    faults: Faults = field(default_factory=Faults)
    # KV events over ZMQ, as vLLM's --kv-events-config; None: off. See kv_events.py.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = DEFAULT_TOPIC
    kv_events_encoding: Encoding = "map"  # current vLLM and SGLang; "array": vLLM <= 0.23
    # LoRA adapters, as vLLM's flags of the same names; see lora.py.
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1  # adapters in GPU slots at once
    lora_load_ms: float = 20.0  # model milliseconds to load one into a slot
    # SGLang's --max-loaded-loras: adapters registered at once; a load beyond is refused
    # until one is unloaded. None: no limit (vLLM).
    max_loaded_loras: int | None = None
    # Model milliseconds a load request takes to read an adapter's weights from disk before
    # it is registered (both engines read them at each load); loads run one at a time.
    lora_register_ms: float = 0.0
    allow_runtime_lora_updating: bool = False  # mounts the load/unload routes
    # Prefill/decode disaggregation (disaggregation.py): SGLang's role flags, or vLLM's
    # connector config, which serves both of its roles on one server.
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT  # 0: any free port
    disaggregation_wait_s: float = 30.0  # real seconds a decode waits for the prefill side
    kv_transfer_config: KvTransferConfig | None = None
    kv_transfer_gbps: float = 100.0  # prefill-to-decode link, gigabits per second
    kv_transfer_ttl_s: float = 60.0  # model seconds a prefill holds KV nobody has fetched

    def __post_init__(self) -> None:
        get_profile(self.profile)  # fail early on a typo
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.kv_events_encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {', '.join(ENCODINGS)}")
        if self.kv_events_endpoint is not None and "://" not in self.kv_events_endpoint:
            raise ValueError("kv_events_endpoint must be a ZMQ endpoint like tcp://*:5557")
        self._check_lora()
        self._check_disaggregation()

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora (--enable-lora)")
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.lora_load_ms < 0:
            raise ValueError("lora_load_ms must not be negative")
        if self.lora_register_ms < 0:
            raise ValueError("lora_register_ms must not be negative")
        if self.max_loaded_loras is not None:
            if self.max_loaded_loras < self.max_loras:
                raise ValueError("max_loaded_loras must be at least max_loras")
            if len(self.lora_modules) > self.max_loaded_loras:
                raise ValueError("The number of LoRA paths should not exceed max_loaded_loras.")
        names = [module.name for module in self.lora_modules]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"lora_modules name the adapter '{name}' twice")
            if name == self.model_name:
                raise ValueError(f"the adapter name '{name}' is the served model's name")

    def _check_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"unknown disaggregation_mode {self.disaggregation_mode!r}; "
                f"one of {', '.join(DISAGGREGATION_MODES)}"
            )
        if self.kv_transfer_config is not None and self.disaggregation_mode != "null":
            raise ValueError(
                "give SGLang's disaggregation_mode or vLLM's kv_transfer_config, not both"
            )
        if not 0 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError("disaggregation_bootstrap_port must be from 0 to 65535")
        for name in ("disaggregation_wait_s", "kv_transfer_gbps", "kv_transfer_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    @property
    def disaggregated(self) -> bool:
        return self.disaggregation_mode != "null" or self.kv_transfer_config is not None

    @property
    def serves_kv(self) -> bool:
        """Whether this replica prefills for others, and so runs the bootstrap server."""
        return self.disaggregation_mode == "prefill" or self.kv_transfer_config is not None

    @property
    def model_name(self) -> str:
        return self.model or f"kvlb-sim-{get_profile(self.profile).model}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            profile=get_profile(self.profile),
            kv_capacity_tokens=self.kv_capacity_tokens,
            block_size=self.block_size,
            max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens,
            max_waiting=self.max_waiting,
            context_limit=self.context_limit,
            max_loras=self.max_loras if self.enable_lora else 0,
            lora_load_s=self.lora_load_ms / 1000 if self.enable_lora else 0.0,
        )
