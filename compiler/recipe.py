"""The recipe: a typed schema for recipes/*.yaml, and one-line errors for anything it refuses.

Every model forbids unknown keys, so a typo (`max_contxt`) is an error naming the key and the
allowed ones, never a silently ignored option.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runtime.backends.registry import Target
from runtime.files import read_utf8

from .errors import RecipeError

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    # A local HF folder, a .gguf file, a hub id already in the local cache, or
    # `package:<python package>/<file inside it>` for weights shipped in a pip package.
    source: str = Field(min_length=1)
    revision: str | None = None
    # Pickle checkpoints can execute code when loaded; they are refused unless asked for, and then
    # loaded with torch's weights_only unpickler.
    allow_pickle: bool = False


class ExportSpec(_Strict):
    opset: int = Field(18, ge=17, le=21)
    # Prompt + generated tokens a sequence may hold. Default: the model's own limit
    # (max_position_embeddings, or the GGUF's context_length), at most DEFAULT_MAX_CONTEXT.
    max_context: int | None = Field(None, ge=1)
    # `last` computes the LM head for the final position only: prefill then costs one vocab
    # projection per row instead of one per prompt token.
    logits: Literal["last", "all"] = "last"
    # Mixture-of-experts layers: `moe` is ONNX Runtime's fused MoE op (each token through its k experts);
    # `dense` runs every expert over every token in standard ONNX ops, the unfused form (for runtimes
    # without the op, and to measure the op against).
    experts: Literal["moe", "dense"] = "moe"


MinOptMax = Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=3, max_length=3)]


class Profiles(_Strict):
    """TensorRT optimization profile ranges, each [min, opt, max]; context counts prompt + generated
    tokens. Without them a tensorrt variant gets default_profiles(export.max_context)."""

    batch: MinOptMax = [1, 8, 32]
    prompt: MinOptMax = [1, 128, 1024]
    context: MinOptMax = [1, 512, 2048]

    @field_validator("batch", "prompt", "context")
    @classmethod
    def _ordered(cls, value: list[int]) -> list[int]:
        if not value[0] <= value[1] <= value[2]:
            raise ValueError(f"must be [min, opt, max] with min <= opt <= max, got {value}")
        return value


class EngineSpec(_Strict):
    """TensorRT builder settings of a tensorrt variant."""

    optimization_level: int = Field(3, ge=0, le=5)  # builder_optimization_level: build time vs kernel search
    workspace_mib: int = Field(4096, ge=16)
    # none: this GPU's architecture only; ampere_plus: any Ampere or newer GPU (slower kernels);
    # same_compute_capability: any GPU of the build GPU's compute capability.
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"
    # A version-compatible engine runs on later TensorRT releases; it carries host code the runtime
    # allows only for verified artifacts.
    version_compatible: bool = False
    # Reused between builds (same TensorRT and GPU); relative to the recipe. Default:
    # ~/.cache/kiln/tensorrt/timing-<TensorRT version>-sm<compute capability>.cache
    timing_cache: str | None = None


def profile_problem(profiles: Profiles, max_context: int) -> str | None:
    """Why these ranges cannot make a working pair of engine profiles, as `key: reason`, or None."""
    prompt, context = profiles.prompt, profiles.context
    if context[2] > max_context:
        return f"context: max {context[2]} exceeds export.max_context {max_context}; lower it or raise max_context"
    if context[2] < 2:
        return "context: max must be at least 2 (a prompt token and a generated one)"
    if prompt[2] >= context[2]:
        return (f"prompt: max {prompt[2]} leaves no room to generate within context max {context[2]}; "
                "make it smaller than the context max")
    return None


def default_profiles(max_context: int) -> Profiles:
    """Ranges for a tensorrt variant that names none: everything export.max_context allows."""
    prompt_max = max(max_context // 2, 1)
    return Profiles(batch=[1, 8, 32], prompt=[1, min(128, prompt_max), prompt_max],
                    context=[1, min(512, max_context), max_context])


class QuantizeSpec(_Strict):
    mode: Literal["int8-dynamic", "int8-static", "int4"]
    # int8-static: a JSON-lines file of {"prompt": ...}, relative to the recipe; the default set
    # ships in compiler/data/calibration.jsonl.
    calibration: str | None = None
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    # int8-dynamic, int4: weights per block of this many input features (MatMulNBits).
    block_size: Literal[16, 32, 64, 128, 256] = 32
    # int8-dynamic, int4: each weight to its nearest level, or GPTQ (compiler/gptq.py): rounding
    # errors pushed onto the weights not yet rounded, by the calibration prompts' activations.
    rounding: Literal["nearest", "gptq"] = "nearest"
    # Module-path globs kept in fp32, e.g. ["lm_head", "model.layers.*.mlp.down_proj"], or `auto`: the
    # module groups the variant needs to meet its gates, most sensitive first, less the heavy ones it
    # passes without; none if everything quantized passes (compiler/sensitivity.py; a per-group
    # sensitivity table in its report when one was needed).
    exclude: list[str] | Literal["auto"] = []
    # int8-dynamic, int4: what `exclude` keeps. Unset: fp32. A block size smaller than block_size: those
    # modules quantized in blocks of it instead, at the mode's bits, so a search keeps its sensitive
    # groups at a quarter of fp32's bytes (SmolLM2: blocks of 128 with the sensitive groups in blocks of
    # 32).
    exclude_block_size: Literal[16, 32, 64, 128] | None = None
    # int8-dynamic, int4, with the LM head quantized: its this-many highest logits recomputed in fp32
    # from the head's fp32 rows (the tied embedding, or a copy), so greedy tokens see the fp32 head's
    # order among them (the rest stay quantized); 0 turns it off.
    exact_top_logits: int = Field(32, ge=0, le=256)
    # int8-dynamic, int8-static: SmoothQuant's migration strength (0..1): each activation channel's
    # range moved that far into the weights before quantizing, folded into the RMSNorm scales and
    # up_proj's and v_proj's columns (compiler/smoothing.py). Unset: no smoothing.
    smoothing: float | None = Field(None, ge=0, le=1)
    # int4: how Kiln's 4-bit CPU kernel (model_kernels.onnx) takes the activations. bf16 (int4's default):
    # rounded to bf16 and multiplied by AVX-512 BF16's VDPBF16PS, or on a CPU without it by FMAs that give
    # the same numbers. int8: quantized per block of 32 as MatMulNBits does. model.onnx quantizes them
    # to int8 either way. SmolLM2 (Q4_1 weights kept exactly): 17 against 99 of 3,177 held-out next-token
    # predictions off fp32's; a decode step 0.93x as fast at batch 1, 0.70x and 0.66x at 8 and 32.
    activations: Literal["int8", "bf16"] | None = None

    @property
    def kernel_activations(self) -> str:
        """What the 4-bit kernel's activations are: the recipe's, or bf16 for int4 and int8 otherwise."""
        return self.activations or ("bf16" if self.mode == "int4" else "int8")

    @field_validator("exclude", mode="before")
    @classmethod
    def _exclude_is_globs_or_auto(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"is {value!r}; give a list of module-path globs such as [lm_head], or auto")
        return value

    @model_validator(mode="after")
    def _rounding_fits_mode(self) -> QuantizeSpec:
        if self.rounding == "gptq" and self.mode == "int8-static":
            raise ValueError("rounding: gptq rounds weight blocks (int8-dynamic, int4); int8-static "
                             "calibrates activation ranges instead: drop rounding or change the mode")
        if self.mode == "int8-static" and self.exact_top_logits and "exact_top_logits" in self.model_fields_set:
            raise ValueError("exact_top_logits rescores a MatMulNBits LM head (int8-dynamic, int4); int8-static's "
                             "QDQ head has none: drop exact_top_logits or change the mode")
        if self.exclude_block_size is not None:
            if self.mode == "int8-static":
                raise ValueError("exclude_block_size sets the blocks of MatMulNBits weights (int8-dynamic, int4); "
                                 "int8-static's weights have none: drop exclude_block_size or change the mode")
            if self.exclude_block_size >= self.block_size:
                raise ValueError(f"exclude_block_size {self.exclude_block_size} is not smaller than block_size "
                                 f"{self.block_size}: the excluded modules get finer blocks than the rest; lower it "
                                 "or raise block_size")
            if not self.exclude:
                raise ValueError("exclude_block_size sets how `exclude` keeps its modules, and exclude is empty: "
                                 "give exclude (module-path globs, or auto) or drop exclude_block_size")
        if self.activations is not None and self.mode != "int4":
            raise ValueError(f"activations sets how Kiln's 4-bit CPU kernel takes them (mode int4); {self.mode} "
                             "quantizes activations to int8: drop activations or change the mode")
        if self.smoothing is not None and self.mode == "int4":
            raise ValueError("smoothing applies to modes int8-dynamic and int8-static; int4 keeps weights on "
                             "their source grid, which smoothing would move them off: drop smoothing or change "
                             "the mode")
        return self


# What each target can execute, as (precision, quantize mode); the schema refuses the rest up front.
BUILDS_BY_TARGET = {
    "onnxruntime": {("fp32", None), ("fp32", "int8-dynamic"), ("fp32", "int8-static"), ("fp32", "int4"),
                    ("fp16", None)},
    "tensorrt": {("fp32", None), ("fp16", None), ("fp32", "int8-static")},
    # Half precision end to end (attention and its KV cache included): ONNX Runtime's CUDA kernels for
    # GroupQueryAttention take fp16 and bf16 only; int4 weights (MatMulNBits) over half activations. A
    # bf16 graph is validated through its fp32 twin (compiler/bf16.py).
    "onnxruntime-cuda": {("fp16", None), ("fp16", "int4"), ("bf16", None), ("bf16", "int4")},
}
DATA = Path(__file__).resolve().parent / "data"  # package data: an installed compiler finds it too
DEFAULT_CALIBRATION = DATA / "calibration.jsonl"
DEFAULT_PROMPTS = DATA / "prompts.jsonl"
DEFAULT_TEXT = DATA / "heldout.txt"
MIN_CALIBRATION_PROMPTS = 8


class Gates(_Strict):
    top1_agreement: float | None = Field(None, ge=0, le=1)
    greedy_match: float | None = Field(None, ge=0, le=1)
    perplexity_change: float | None = Field(None, ge=0)
    max_logit_error: float | None = Field(None, gt=0)
    kl_divergence: float | None = Field(None, ge=0)
    prefill_cosine: float | None = Field(None, ge=-1, le=1)
    tokens_per_second_ratio: float | None = Field(None, gt=0)


class Variant(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    target: Literal["onnxruntime", "onnxruntime-cuda", "tensorrt"]
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    quantize: QuantizeSpec | None = None
    # onnxruntime: contrib-op fusions (GroupQueryAttention over shared KV buffers, RMSNorm). tensorrt
    # graphs always stay standard ONNX.
    fuse: bool = True
    profiles: Profiles | None = None
    engine: EngineSpec | None = None
    # Overrides validate.gates for this variant (a quantized variant may get looser ones).
    gates: Gates | None = None
    # The KV cache's type in the graph for Kiln's CPU kernels (runtime/kernels/attention.c), where every
    # attention is the kernel's: float16 halves the cache's memory and what a decode step reads of it, for
    # numbers rounded to fp16 once as they are stored; int8 takes 1.25 x head size bytes a slot and head
    # where fp32 takes 4 x head size (the codes and an fp32 scale a block of 16). Measured against eager
    # under the variant's gates. model.onnx, which any ONNX Runtime opens, keeps an fp32 cache.
    kv_cache: Literal["float32", "float16", "int8"] = "float32"
    # "optional": the gates hold every graph the variant ships (model.onnx, which any ONNX Runtime runs, and
    # the graph for Kiln's CPU kernels), and a host without the kernels runs model.onnx. "required": the
    # variant is for hosts that run Kiln's CPU kernels (runtime/cpu_kernels.py): the gates hold their graph,
    # model.onnx is measured and reported but not gated, and the runtime refuses the variant where the
    # kernels do not run. For a variant more exact on the kernels than on ONNX Runtime's own: SmolLM2's int4
    # with bf16 activations scores top-1 0.995 on the kernel, its model.onnx (int8 activations) 0.971.
    cpu_kernels: Literal["optional", "required"] = "optional"

    @model_validator(mode="after")
    def _fits_target(self) -> Variant:
        if self.profiles is not None and self.target != Target.TENSORRT:
            raise ValueError("profiles: only tensorrt variants take optimization profiles")
        if self.engine is not None and self.target != Target.TENSORRT:
            raise ValueError("engine: only tensorrt variants build engines")
        if self.target == Target.ONNXRUNTIME_CUDA and not self.fuse:
            raise ValueError("fuse: false cannot be built for onnxruntime-cuda: its attention is ONNX Runtime's "
                             "GroupQueryAttention over a KV buffer updated in place; leave fuse out")
        onnxruntime_fp32_fused = self.target == Target.ONNXRUNTIME and self.fuse and self.precision == "fp32"
        if self.kv_cache != "float32" and not onnxruntime_fp32_fused:
            raise ValueError(f"kv_cache: {self.kv_cache} is for fp32 onnxruntime variants with fuse on, quantized or "
                             "not (the cache of Kiln's CPU kernels' attention); leave it out here")
        if self.cpu_kernels == "required" and self.target != Target.ONNXRUNTIME:
            raise ValueError("cpu_kernels: required is for onnxruntime variants (Kiln's CPU kernels run their graphs); "
                             "leave it out here")
        if self.cpu_kernels == "required" and self.quantize is not None and self.quantize.exclude == "auto":
            raise ValueError("cpu_kernels: required with exclude: auto: the search measures model.onnx, not the "
                             "kernels' graph; name the modules to exclude, or leave exclude out")
        build = (self.precision, self.quantize.mode if self.quantize else None)
        if build not in BUILDS_BY_TARGET[self.target]:
            allowed = ", ".join(f"{p}" + (f" + {m}" if m else "") for p, m in sorted(
                BUILDS_BY_TARGET[self.target], key=lambda b: (b[0], b[1] or "")))
            asked = build[0] + (f" + {build[1]}" if build[1] else "")
            raise ValueError(f"{asked} cannot be built for {self.target}; allowed: {allowed}")
        return self


class ValidateSpec(_Strict):
    # JSON lines of {"prompt": ...} and a plain-text file, relative to the recipe; the defaults ship
    # in compiler/data/.
    prompts: str | None = None
    text: str | None = None
    max_new_tokens: int = Field(32, ge=1)
    gates: Gates = Gates()


class Recipe(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    model: ModelSpec
    export: ExportSpec = ExportSpec()
    variants: list[Variant] = Field(
        default_factory=lambda: [Variant(name="cpu-fp32", target="onnxruntime")], min_length=1
    )
    validate_: ValidateSpec = Field(ValidateSpec(), alias="validate")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        names = [v.name for v in self.variants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"variants: names must be unique, repeated: {', '.join(duplicates)}")
        for v in self.variants:
            if v.profiles is not None and self.export.max_context is not None:  # else once it is resolved
                problem = profile_problem(v.profiles, self.export.max_context)
                if problem:
                    raise ValueError(f"variants.{v.name}.profiles.{problem}")
        return self

    def select_variants(self, names: typing.Sequence[str]) -> list[Variant]:
        """The variants to build: all of them, or those named on the command line."""
        if not names:
            return list(self.variants)
        known = {v.name: v for v in self.variants}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise RecipeError(f"--variant {unknown[0]}: no such variant; the recipe has: {', '.join(known)}")
        return [known[n] for n in names]


def load_recipe(path: str | Path) -> tuple[Recipe, Path]:
    """Parse and validate a recipe file. Returns the recipe and the folder its relative paths use."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path}: no such file")
    try:
        data = yaml.safe_load(read_utf8(path, f"recipe {path}", "YAML", RecipeError))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"recipe {path}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: must be a YAML mapping with keys name, model, export, variants, validate")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"recipe {path}: {describe_validation_error(exc)}") from None
    base = path.parent
    _check_data_files(recipe, base, path)
    return recipe, base


def _check_data_files(recipe: Recipe, base: Path, path: Path) -> None:
    for key, name, minimum in _data_files(recipe):
        file = base / name if name else DEFAULT_CALIBRATION
        where = f"recipe {path}: {key}: file {file}"
        if not file.is_file():
            raise RecipeError(f"{where} does not exist")
        count = len(read_prompts(file, where))
        if count < minimum:
            raise RecipeError(f"{where} has {count} prompts; at least {minimum} are needed for meaningful ranges")
    text = recipe.validate_.text
    if text is not None and not (base / text).is_file():
        raise RecipeError(f"recipe {path}: validate.text: file {base / text} does not exist")


def _data_files(recipe: Recipe) -> list[tuple[str, str | None, int]]:
    found = []
    if recipe.validate_.prompts is not None:
        found.append(("validate.prompts", recipe.validate_.prompts, 1))
    for i, v in enumerate(recipe.variants):
        if v.quantize is not None and v.quantize.mode == "int8-static":
            found.append((f"variants.{i}.quantize.calibration", v.quantize.calibration, MIN_CALIBRATION_PROMPTS))
    return found


DEFAULT_MAX_CONTEXT = 2048


def with_max_context(recipe: Recipe, max_context: int, where: str) -> Recipe:
    """The recipe with export.max_context filled in, validated again (profiles against it)."""
    data = recipe.model_dump(by_alias=True)
    data["export"]["max_context"] = max_context
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"recipe {where}: {describe_validation_error(exc)} (export.max_context defaulted to "
                          f"{max_context}, the model's limit)") from None


def read_prompts(file: Path, where: str = "") -> list[str]:
    """A JSON-lines file of {"prompt": "..."} objects; blank lines are skipped."""
    import json

    prompts = []
    text = read_utf8(file, where or f"prompts file {file}", "JSON lines", RecipeError)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError(f"{where or file}: line {number} is not JSON: {exc.msg}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise RecipeError(f'{where or file}: line {number} must be an object with a non-empty "prompt" string')
        prompts.append(entry["prompt"])
    return prompts


def describe_validation_error(exc: ValidationError) -> str:
    """The first schema error as `key.path: what is wrong; what is allowed`."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = ", ".join(_allowed_keys(Recipe, loc[:-1]))
        return f"{key}: unknown key; allowed keys here: {allowed}"
    if kind == "missing":
        return f"{key}: required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        # Raised by our own validators, which already name the key and the rule.
        prefix = f"{key}: " if key != "(top level)" else ""
        return prefix + message
    got = err.get("input")
    shown = f" (got {got!r})" if not isinstance(got, dict | list) else ""
    return f"{key}: {message[0].lower()}{message[1:]}{shown}"


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        nested = _model_in(field.annotation) if field else None
        if nested is None:
            return []
        model = nested
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def resolve_path(base: Path, relative: str) -> Path:
    """Paths in a recipe are relative to the recipe file, like includes in a Makefile."""
    return (base / relative).resolve()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-")
