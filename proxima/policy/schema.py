"""The policy language: pydantic models that a YAML policy file fills.

A policy says *when* to compress (pressure bands with hysteresis), *how* (an ordered ladder of
formats per band, per-layer substitutions of equal pack ratio), *what never to touch* (protected
windows), *how fast* (a per-step budget), *what it costs* (a damage table the engine minimises,
error bounds the compression-time probe enforces) and *how to back off* (a fallback ladder fed by
quality probes). `proxima policy schema` prints the JSON Schema of `Policy` for editors.

Every model forbids unknown keys, so a typo is an error with its location, never a silent default.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from proxima.formats import DEFAULT_GROUP_SIZE, HOT, Format, FormatError, recompressible

SCHEMA_VERSION = 1


def _to_format(value: object) -> Format:
    if isinstance(value, Format):
        return value
    try:
        return Format.parse(value)  # type: ignore[arg-type]
    except FormatError as exc:
        raise ValueError(str(exc)) from None


FormatField = Annotated[
    Format,
    PlainValidator(_to_format),
    PlainSerializer(lambda f: f.name, return_type=str),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^((sparse|cluster)\(\d+\))?\+?(bf16|fp8|int8|int4|int2)?$",
            "examples": ["int8", "int4", "sparse(4)", "cluster(2)+int8"],
        }
    ),
]
"""A format written as a string in YAML (see `proxima.formats`)."""


class _Model(BaseModel):
    # allow_inf_nan=False: a policy holding .inf or .nan could not be served back as JSON.
    # strict=True: no type coercion, so `true` is not the integer 1 (nor 1.0), "yes" or 1 is not
    # a bool, and "64" is not a number; YAML and JSON already give every value its real type.
    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False, strict=True
    )


class Band(_Model):
    """A pressure band: active from `enter` upward until pressure falls below `exit`."""

    name: str = Field(min_length=1, max_length=64)
    """Shown in logs, metrics and the simulator."""
    enter: float = Field(ge=0.0, le=1.0)
    """Pressure (used fraction of physical KV blocks, pending allocations included) that activates the band."""
    exit: float = Field(ge=0.0, le=1.0)
    """Pressure below which the band deactivates again; must not exceed `enter` (hysteresis)."""
    target_free: float = Field(gt=0.0, lt=1.0)
    """While the band is active, compress until this fraction of physical blocks is free."""
    ladder: list[FormatField] = Field(min_length=1)
    """Formats the engine may choose from in this band, mildest first (e.g. [int8, int4, sparse(4)])."""

    @field_validator("ladder")
    @classmethod
    def _no_hot_in_ladder(cls, v: list[Format]) -> list[Format]:
        for f in v:
            if f.is_hot:
                raise ValueError("bf16 is the uncompressed format and cannot be a ladder rung")
        if len(set(v)) != len(v):
            raise ValueError("a format appears twice in the ladder")
        return v

    @model_validator(mode="after")
    def _hysteresis(self) -> Band:
        if self.exit > self.enter:
            raise ValueError(f"exit ({self.exit}) must be <= enter ({self.enter}) for hysteresis")
        if self.target_free <= 1.0 - self.enter:
            # Entering at pressure p leaves 1-p free, which already meets such a target.
            raise ValueError(
                f"target_free ({self.target_free}) must exceed 1 - enter ({1.0 - self.enter:.3g}), "
                "or the band's target is met whenever it is entered and it never compresses"
            )
        return self


class Protect(_Model):
    """Tokens that are never compressed (attention sinks and the recent window)."""

    sink_tokens: int = Field(default=64, ge=0, le=1 << 20)
    """The first N tokens of every request (attention sinks) stay uncompressed."""
    recent_tokens: int = Field(default=256, ge=0, le=1 << 20)
    """The last N tokens of every request stay uncompressed (the hot tail block always does)."""
    prefilling: bool = True
    """Every block of a request stays uncompressed until its whole prompt is prefilled. False:
    with chunked prefill, the finished chunks of a long prompt are compressible while the rest
    is prefilled (admission then needs one chunk's blocks, not the whole prompt; the rest of the
    prompt attends to the compressed chunks, which costs some quality)."""
    recent_mild_tokens: int = Field(default=0, ge=0, le=1 << 20)
    """Blocks holding any of the last N tokens of a request (before `recent_tokens`' hot window)
    take at most the active band's mildest permitted rung: quantized, never merged, while they are
    recent. 0: off. For a request compressed before its question arrives, the newest context
    (a passkey near the end) keeps its tokens; as the request grows, its blocks leave the window
    and may be merged."""
    merged_tokens: int = Field(default=0, ge=0, le=1024)
    """When a block is merged (a cluster(R) rung, a first merge or the recompression of a merged
    block), this many of its tokens per KV head stay exact, each a centroid of count 1 in the
    block's own slot: "k exact tokens plus C - k centroids" in the same bytes (capped at C - 1
    rows of a slot of C). 0: every row is a centroid. Which tokens: `merged_by`."""
    merged_by: Literal["mixed", "outlier", "importance"] = "mixed"
    """How `merged_tokens` are picked per (block, KV head): `importance` (observed attention),
    `outlier` (the keys farthest from the block's mean key: what a block compressed before its
    question holds that no query has marked) or `mixed` (alternately, an outlier first; all
    outliers where the block's importance is uniform)."""


class Budget(_Model):
    """How much work one engine step may do."""

    max_blocks_per_step: int = Field(default=256, ge=1, le=1_000_000)
    """At most this many logical blocks are (re)compressed in one engine step."""


class Importance(_Model):
    """How attention mass becomes a block's importance."""

    aggregate: Literal["max", "mean"] = "max"
    """How a block's attention mass is combined over layers and heads."""
    ema_decay: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Exponential moving average factor for per-block attention mass (higher = longer memory)."""
    observation_window: int = Field(default=32, ge=1, le=4096)
    """Recent queries per layer kept to score tokens at compression time (sparsify, cluster weights)."""


class Storage(_Model):
    """How compressed blocks are laid out. Fixed for a server's lifetime: a slot written with one
    group size cannot be read with another, so a live policy change that alters it is refused
    (`proxima.policy.store.PolicyStore`)."""

    group_size: int = Field(default=DEFAULT_GROUP_SIZE, ge=1, le=1 << 16)
    """KIVI quantization group (int8 / int4 / int2): keys per channel in groups of this many tokens,
    int4 / int2 values per token in groups of this many channels (it must divide the head dim;
    checked against the model at start-up). A power of two. Larger groups hold less metadata
    (int4 at block 64, head_dim 64: 3.20x bytes at 32, 3.56x at 64) and cost precision:
    bench/results/experiments/groups/."""

    group_sizes: dict[Literal["int8", "int4", "int2"], Annotated[int, Field(ge=1, le=1 << 16)]] = Field(
        default_factory=dict
    )
    """Per quantization, a group that replaces `group_size` for it, e.g. `{int4: 64}`: the measured
    trade differs by format (on SmolLM2, int4 at 64 keeps uniform int4's quality for 11% more bytes
    ratio; int2 at 64 loses passkeys)."""

    @field_validator("group_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"group_size must be a power of two (16, 32, 64, ...), got {v}")
        return v

    @field_validator("group_sizes")
    @classmethod
    def _pow2_each(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {q: g for q, g in v.items() if g & (g - 1)}
        if bad:
            raise ValueError(f"group sizes must be powers of two (16, 32, 64, ...), got {bad}")
        return v

    @property
    def smallest_group(self) -> int:
        """The smallest KIVI group any format of this storage uses (the one-pass decode compiles
        its per-token key scale rows only where a group is below the block size)."""
        return min([self.group_size, *self.group_sizes.values()])

    def group_for(self, fmt: Format) -> int:
        """The group every slot of `fmt` is quantized with (formats that are not KIVI-grouped ignore it)."""
        return self.group_sizes.get(fmt.quant, self.group_size)  # type: ignore[arg-type]

    def field_for(self, fmt: Format) -> str:
        """The policy field `group_for(fmt)` comes from (for error messages)."""
        return f"storage.group_sizes.{fmt.quant}" if fmt.quant in self.group_sizes else "storage.group_size"


class LayerOverride(_Model):
    """In the listed layers, use another format of the *same pack ratio* (one block id spans all layers)."""

    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Layer indices the substitution applies to."""
    substitute: dict[str, FormatField] = Field(min_length=1)
    """Map of chosen format -> format used in these layers instead, e.g. {"sparse(4)": "int4"}."""

    @field_validator("substitute")
    @classmethod
    def _equal_ratio(cls, v: dict[str, Format]) -> dict[str, Format]:
        out: dict[str, Format] = {}
        for key, dst in v.items():
            src = _to_format(key)
            if src.pack_ratio != dst.pack_ratio:
                raise ValueError(
                    f"{src.name} (ratio {src.pack_ratio}) cannot become {dst.name} (ratio {dst.pack_ratio}): "
                    "a block's pack ratio is the same in every layer"
                )
            out[src.name] = dst
        return out


# Predicted relative attention-output error of each format on a block of average importance.
# Defaults are deliberately conservative orders of magnitude (quantization is cheap, token
# reduction expensive, per ../shared/FACTS.md); `proxima calibrate` replaces them with measured values.
DEFAULT_QUANT_DAMAGE = {
    "bf16": 0.0, "fp8": 0.02, "int8": 0.005, "int4": 0.04, "int2": 0.35, "int4h": 0.04, "int2h": 0.35,
}  # fmt: skip
DEFAULT_REDUCTION_DAMAGE = {"sparse": 0.30, "cluster": 0.20}


def default_damage(fmt: Format) -> float:
    """Built-in damage estimate: quantization error plus a reduction error growing with 1 - 1/R."""
    red = 0.0
    if fmt.reduction is not None:
        red = DEFAULT_REDUCTION_DAMAGE[fmt.reduction] * (1.0 - 1.0 / fmt.reduction_ratio) * 2.0
    return DEFAULT_QUANT_DAMAGE[fmt.quant] + red


class Damage(_Model):
    """The damage model the engine minimises: predicted error per format, as data."""

    table: dict[str, Annotated[float, Field(ge=0.0)]] = Field(default_factory=dict)
    """Format name -> predicted relative error; formats not listed use the built-in estimate."""

    @field_validator("table")
    @classmethod
    def _known_formats(cls, v: dict[str, float]) -> dict[str, float]:
        return {_to_format(k).name: x for k, x in v.items()}

    def of(self, fmt: Format) -> float:
        return self.table.get(fmt.name, default_damage(fmt))


class CompressionProbe(_Model):
    """Compression-time probe: reject an action whose attention-output error is too large."""

    enabled: bool = True
    """Measure the error of each action on the observation-window queries before applying it."""
    max_error: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=lambda: {"fp8": 0.12, "int8": 0.05, "int4": 0.25}
    )
    """Format name -> largest acceptable relative error of the attention output. The defaults are
    about 3x each format's median error on SmolLM2 (proxima/quality/data/damage-smollm2.json:
    int8 0.017, fp8 0.048, int4 0.086; int2 0.46 is over `default_max_error`)."""
    default_max_error: float = Field(default=0.15, gt=0.0)
    """Bound for formats not listed in `max_error`."""
    window_blocks: int = Field(default=16, ge=1)
    """Blocks measured per verdict (what the fallback ladder counts): one verdict per this many
    measurements, however many steps they take, so a stray block never decides alone."""
    max_refused_fraction: float = Field(default=0.25, ge=0.0, lt=1.0)
    """A verdict fails when more than this fraction of its window's blocks were over the bound in
    the format the engine chose."""

    @field_validator("max_error")
    @classmethod
    def _known_formats(cls, v: dict[str, float]) -> dict[str, float]:
        return {_to_format(k).name: x for k, x in v.items()}

    def bound(self, fmt: Format) -> float:
        return self.max_error.get(fmt.name, self.default_max_error)


class CanaryProbe(_Model):
    """Fixed prompts rerun under the live policy against uncompressed reference log-probs."""

    enabled: bool = False
    interval_s: float = Field(default=300.0, gt=0.0)
    """Seconds between canary runs."""
    max_kl: float = Field(default=0.05, gt=0.0)
    """Mean KL(reference || live) above which the canary fails."""
    min_top1: float = Field(default=0.95, ge=0.0, le=1.0)
    """Top-1 agreement with the reference below which the canary fails."""


class DriftProbe(_Model):
    """Compressed requests against an uncompressed holdout share."""

    enabled: bool = False
    holdout_fraction: float = Field(default=0.02, ge=0.0, le=0.5)
    """Share of requests served uncompressed as the reference population."""
    window: int = Field(default=200, ge=10)
    """Requests per side compared in one test."""
    p_value: float = Field(default=0.01, gt=0.0, lt=1.0)
    """Significance level of one verdict (its false-alarm rate on a good policy): the tests on
    per-request log-prob and entropy share it, each at p_value / 2 (`probes.drift_test`)."""

    @model_validator(mode="after")
    def _level_reachable(self) -> DriftProbe:
        # The verdict's paired signed-rank test can give no p below 2^-window (every pair one
        # way): a lower level would make the probe unable to ever fail (probes.smallest_paired_p).
        if self.enabled and self.p_value / 2.0 < 0.5 ** self.window:
            raise ValueError(f"p_value {self.p_value:g} cannot be reached with window {self.window}: "
                             f"the smallest p of {self.window} request pairs is {0.5 ** self.window:.3g} "
                             "per test (p_value / 2); raise the window or the p_value")
        return self


class Probes(_Model):
    compression: CompressionProbe = CompressionProbe()
    canary: CanaryProbe = CanaryProbe()
    drift: DriftProbe = DriftProbe()


class FallbackLevel(_Model):
    """One rung of the fallback ladder: a restriction on what the engine may do."""

    name: str = Field(min_length=1, max_length=64)
    max_pack_ratio: int = Field(default=64, ge=1)
    """Formats with a higher pack ratio are not used at this level (1 = compression off)."""
    allow: list[str] | None = None
    """If set, only these formats (by name) may be used at this level."""

    @field_validator("allow")
    @classmethod
    def _known_formats(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [_to_format(x).name for x in v]

    def permits(self, fmt: Format) -> bool:
        if fmt.pack_ratio > self.max_pack_ratio:
            return False
        return self.allow is None or fmt.name in self.allow


def _default_levels() -> list[FallbackLevel]:
    return [
        FallbackLevel(name="full"),
        FallbackLevel(name="quantize-only", allow=["fp8", "int8", "int4"]),
        FallbackLevel(name="int8-only", allow=["int8", "fp8"]),
        FallbackLevel(name="off", max_pack_ratio=1),
    ]


class Fallback(_Model):
    """The automatic fallback ladder (level 0 is the policy as written)."""

    levels: list[FallbackLevel] = Field(default_factory=_default_levels, min_length=1)
    """Ordered from least to most restrictive."""
    failures_to_step_down: int = Field(default=2, ge=1)
    """Consecutive probe failures that step one level down."""
    passes_to_step_up: int = Field(default=5, ge=1)
    """Consecutive probe passes (after the cooldown) that step one level back up."""
    cooldown_s: float = Field(default=120.0, ge=0.0)
    """After a step down, hold the level at least this long."""

    @field_validator("levels")
    @classmethod
    def _unique_names(cls, v: list[FallbackLevel]) -> list[FallbackLevel]:
        names = [lv.name for lv in v]
        if len(set(names)) != len(names):
            raise ValueError(f"fallback level names must be unique, got {names}")
        return v


class Webhook(_Model):
    url: str = Field(pattern=r"^https?://")
    """POSTed a JSON body for every alert."""
    timeout_s: float = Field(default=2.0, gt=0.0, le=60.0)
    retries: int = Field(default=2, ge=0, le=10)


class Alerts(_Model):
    log: bool = True
    """Write every alert to the log."""
    webhook: Webhook | None = None


class Api(_Model):
    """The runtime tuning API (see README)."""

    enabled: bool = False
    host: str = "127.0.0.1"
    """Bind address; keep loopback unless a proxy with TLS is in front."""
    port: int = Field(default=8765, ge=1, le=65535)
    token_env: str = "PROXIMA_API_TOKEN"
    """Environment variable holding the bearer token for mutating calls."""
    token_file: str | None = None
    """File holding the bearer token (takes precedence over `token_env`)."""
    max_body_bytes: int = Field(default=65536, ge=1024, le=16 << 20)


class Policy(_Model):
    """A complete Proxima policy."""

    schema_version: Literal[1] = 1
    """Version of this policy language."""

    @field_validator("schema_version", mode="before")
    @classmethod
    def _schema_version_not_bool(cls, v: object) -> object:
        # Literal[1] compares by equality, and True == 1: strict mode alone lets `true` through.
        if isinstance(v, bool):
            raise ValueError("schema_version must be the integer 1, not a boolean")
        return v
    name: str = Field(default="unnamed", min_length=1, max_length=64)
    description: str = ""
    enabled: bool = True
    """False turns Proxima into a pass-through: vLLM behaves exactly as without it."""
    bands: list[Band] = Field(default_factory=list)
    """Pressure bands, ordered by rising `enter`."""
    protect: Protect = Protect()
    budget: Budget = Budget()
    importance: Importance = Importance()
    layer_overrides: list[LayerOverride] = Field(default_factory=list)
    storage: Storage = Storage()
    damage: Damage = Damage()
    probes: Probes = Probes()
    fallback: Fallback = Fallback()
    alerts: Alerts = Alerts()
    api: Api = Api()

    @model_validator(mode="after")
    def _bands_ordered(self) -> Policy:
        enters = [b.enter for b in self.bands]
        if enters != sorted(enters) or len(set(enters)) != len(enters):
            raise ValueError(f"bands must be ordered by strictly rising 'enter', got {enters}")
        names = [b.name for b in self.bands]
        if len(set(names)) != len(names):
            raise ValueError(f"band names must be unique, got {names}")
        if self.enabled and not self.bands:
            raise ValueError("an enabled policy needs at least one band (or set enabled: false)")
        merges = any(f.reduction == "cluster" for f in self.stored_formats())
        if self.protect.merged_tokens and self.enabled and not merges:
            raise ValueError(
                f"protect.merged_tokens: {self.protect.merged_tokens} protects tokens inside merged blocks, "
                "but no band's ladder merges (a cluster(R) format); set it to 0 or add a cluster rung"
            )
        return self

    @property
    def is_off(self) -> bool:
        return not self.enabled or not self.bands

    def layer_format(self, fmt: Format, layer: int) -> Format:
        """The format actually stored in `layer` when the engine chose `fmt` for a block."""
        for ov in self.layer_overrides:
            if layer in ov.layers and fmt.name in ov.substitute:
                return ov.substitute[fmt.name]
        return fmt

    def stored_formats(self, layers: int | None = None) -> set[Format]:
        """Every format a layer can store under this policy (its ladders after `layer_format`): in
        layers 0..layers-1, or, without a count, in any layer (layer 0 standing for the layers no
        override names)."""
        where = range(layers) if layers is not None else {0, *(i for ov in self.layer_overrides for i in ov.layers)}
        return {self.layer_format(f, li) for f in self.all_formats() for li in where}

    def can_recompress(self, src: Format, dst: Format) -> bool:
        """A block the engine put in `src` can move to `dst` in every layer (`proxima.formats.
        recompressible` on each layer's stored formats, `layer_format`): towards a higher pack
        ratio, and a merged or sparsified block only into a reduction at least as strong. From
        hot: into any compressed format. Layers no override names store `src` and `dst` as they are."""
        layers = {layer for ov in self.layer_overrides for layer in ov.layers}
        pairs = [(src, dst)] + [(self.layer_format(src, layer), self.layer_format(dst, layer)) for layer in layers]
        return all(recompressible(a, b) for a, b in pairs)

    def all_formats(self) -> list[Format]:
        seen: dict[Format, None] = {}
        for b in self.bands:
            for f in b.ladder:
                seen[f] = None
        return list(seen)


OFF = Policy(name="off", enabled=False)
__all__ = ["HOT", "OFF", "SCHEMA_VERSION", "Band", "Policy", "Storage", "default_damage"]
