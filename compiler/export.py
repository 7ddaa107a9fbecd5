"""The export stage: torch model -> one ONNX graph with KV-cache inputs and outputs.

One graph serves prefill (past = 0) and decode (seq = 1): batch, seq and past are dynamic.

    input_ids [b, s] ─┐
    attention_mask [b, p+s] ─┤                      ┌─> logits [b, 1 | s, vocab]
    position_ids [b, s] ─────┼─> transformers model ┤
    past_key_values.{i}.key/value [b, kv, p, d] ─┘  └─> present.{i}.key/value [b, kv, p+s, d]

The exporter is torch.onnx's dynamo path (torch.export): it traces the transformers model through
its real Cache classes with symbolic shapes, so no branch is frozen at trace time (the TorchScript
path froze them) and the graph is about a third the size. Sample inputs use batch, seq, past >= 2
because torch.export specialises dimensions of size 0 and 1; past = 0 is then checked by the
validate stage like every other shape.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import moe
from .errors import ExportError
from .families import Shapes, shapes_of
from .fp32_compute import stop_computing_in_fp32
from .graph import MODEL_FILE, OnnxArtifact, saved_graph
from .load import Checkpoint
from .recipe import ExportSpec

SCRATCH_WEIGHTS_FILE = "weights.scratch"  # the model's weights while it is traced without them
INPUTS = ("input_ids", "attention_mask", "position_ids")


def kv_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def graph_interface(shapes: Shapes, logits: str) -> dict[str, Any]:
    """The graph interface of the architecture doc, as recorded in manifest.json. KV names are
    templates over `{layer}` in range(layers), so the manifest stays readable for 30+ layers."""
    kv_in = ["batch", shapes.kv_heads, "past", shapes.head_dim]
    kv_out = ["batch", shapes.kv_heads, "past + seq", shapes.head_dim]
    logits_shape = ["batch", 1 if logits == "last" else "seq", shapes.vocab_size]
    return {
        "inputs": [
            {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
            {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "past + seq"]},
            {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"]},
            {"name": "past_key_values.{layer}.key", "dtype": "float32", "shape": kv_in},
            {"name": "past_key_values.{layer}.value", "dtype": "float32", "shape": kv_in},
        ],
        "outputs": [
            {"name": "logits", "dtype": "float32", "shape": logits_shape},
            {"name": "present.{layer}.key", "dtype": "float32", "shape": kv_out},
            {"name": "present.{layer}.value", "dtype": "float32", "shape": kv_out},
        ],
        "layers": shapes.layers,
        "logits": logits,
        "kv_layout": "batch, kv_heads, sequence, head_dim",
        "kv_sharing": "none",  # present is a new tensor: past followed by this step's keys and values
        "padding": "left",
        "kv_heads": shapes.kv_heads,
        "head_dim": shapes.head_dim,
        "vocab_size": shapes.vocab_size,
    }


def _make_wrapper(model: Any, layers: int, logits: str) -> Any:
    import torch
    from transformers import DynamicCache

    keep = 1 if logits == "last" else 0  # transformers: logits_to_keep=0 keeps every position

    class KvCacheLM(torch.nn.Module):
        """Flat tensors in and out around the model's Cache object, so ONNX sees plain names."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):  # noqa: ANN001
            # No config: full-length layers for every family. Sliding-window families (Mistral)
            # apply their window through the attention mask, and present stays past + seq long.
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=keep,
            )
            present = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    return KvCacheLM().eval()


def sample_inputs(shapes: Shapes, batch: int, seq: int, past: int) -> tuple:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shapes.vocab_size, (batch, seq), generator=generator)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv_shape = (batch, shapes.kv_heads, past, shapes.head_dim)
    kv = [torch.randn(kv_shape, generator=generator) for _ in range(2 * shapes.layers)]
    return (ids, mask, positions, *kv)


def export(checkpoint: Checkpoint, cfg: ExportSpec, folder: Path, debug: bool = False) -> OnnxArtifact:
    """The checkpoint's model as one ONNX graph in `folder`. Its last use: the model is left without
    its weights (on torch's meta device).

    The trace needs the weights' shapes, not their values, and its own working set is large (0.25 GiB
    at 135M: FX graphs, symbolic shapes, the decompositions). So the weights go to a scratch file
    first and the model is traced on the meta device, holding none; the graph then reads them back
    one at a time as it is optimized and saved. A model whose trace needs real values (a constant
    computed from a weight, Falcon's) gets them back from the same file and is traced as it was."""
    shapes = shapes_of(checkpoint.config)
    stop_computing_in_fp32(checkpoint.model)  # its weights are traced as fp32 on the meta device instead
    experts = moe.prepare_for_export(checkpoint.model)  # each layer's experts: one MoE node
    traceable_rotary(checkpoint.model)
    wrapper = _make_wrapper(checkpoint.model, shapes.layers, cfg.logits)
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / SCRATCH_WEIGHTS_FILE
    try:
        weights = WeightsFile.written(wrapper, scratch)
        _weights_on_meta(wrapper)
        try:
            program = _trace(wrapper, shapes, cfg, "meta", debug, checkpoint.source.spec, experts)
            weights.attach(program.model)  # raises ValueError where the graph holds a value only torch had
        except (ExportError, ValueError) as exc:
            logging.getLogger(__name__).debug("traced again with the weights: %s", exc)
            weights.put_back(wrapper)
            program = _trace(wrapper, shapes, cfg, "cpu", debug, checkpoint.source.spec, experts)
            _weights_on_meta(wrapper)
        program.exported_program = None  # the FX graph and its symbolic shapes: not needed past here
        try:
            with small_constants_kept():
                program.optimize()
            widen_bf16_arithmetic(program.model)
            program.save(str(folder / MODEL_FILE), external_data=True)
        except Exception as exc:  # onnxscript's rewriter and onnx_ir raise many types; all mean the same
            raise _export_error(exc, checkpoint.source.spec) from exc
        del program
        forget_matched_graphs()
    finally:
        scratch.unlink(missing_ok=True)
    return saved_graph(folder, graph_interface(shapes, cfg.logits), shapes)


def traceable_rotary(model: Any) -> int:
    """Rotary modules whose scale is chosen by a Python branch on the positions, given a forward that
    computes the same numbers without one (torch.export cannot trace a branch on a tensor's value).
    PhiMoE's longrope (Phi-3.5-MoE) multiplies cos and sin by long_mscale once the positions pass
    original_max_position_embeddings, else by short_mscale; its frequencies are the short factors'
    either way (transformers recomputes them from the config on each call, without the positions).
    transformers picks the scale by the batch's largest position; here each row's own largest
    position picks it, so a row's numbers do not depend on its neighbours (eager's alone). Returns how
    many modules were changed."""
    import types

    import torch

    def forward(self: Any, x: Any, position_ids: Any = None) -> tuple[Any, Any]:
        rope = self.config.rope_parameters
        inv_freq, scaling = self.rope_init_fn(self.config)
        if rope["rope_type"] != "default":
            past_original = position_ids.amax(dim=-1, keepdim=True)[..., None] + 1 > rope[
                "original_max_position_embeddings"]
            scaling = torch.where(past_original, torch.tensor(rope["long_mscale"], dtype=torch.float32),
                                  torch.tensor(rope["short_mscale"], dtype=torch.float32))
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(x.dtype), (angles.sin() * scaling).to(x.dtype)

    changed = 0
    for module in model.modules():
        if type(module).__name__ == "PhimoeRotaryEmbedding":
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed


# Elementwise ops ONNX Runtime's CPU provider has no bfloat16 kernel for.
BF16_ARITHMETIC = ("Add", "Sub", "Mul", "Div")


def widen_bf16_arithmetic(model: Any) -> int:
    """Elementwise arithmetic a model does in bfloat16 (Falcon's ALiBi slopes times positions) computed in
    fp32 and rounded back to bfloat16: the same numbers, since the exact fp32 result of two bfloat16
    operands rounds as torch's bfloat16 op rounds it, and ONNX Runtime's CPU provider has no bfloat16
    Mul. Returns how many nodes were widened."""
    import onnx_ir as ir

    widened = 0
    for node in list(model.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in BF16_ARITHMETIC:
            continue
        result = node.outputs[0]
        if result.dtype != ir.DataType.BFLOAT16:
            continue
        for index, operand in enumerate(node.inputs):
            up = ir.node("Cast", [operand], {"to": ir.DataType.FLOAT}, name=f"{node.name}_widen_{index}")
            up.outputs[0].dtype = ir.DataType.FLOAT
            up.outputs[0].shape = operand.shape
            model.graph.insert_before(node, up)
            node.replace_input_with(index, up.outputs[0])
        down = ir.node("Cast", [result], {"to": ir.DataType.BFLOAT16}, name=f"{node.name}_round")
        down.outputs[0].dtype, down.outputs[0].shape = ir.DataType.BFLOAT16, result.shape
        for usage in list(result.uses()):
            if usage.node is not down:
                usage.node.replace_input_with(usage.idx, down.outputs[0])
        result.dtype = ir.DataType.FLOAT
        model.graph.insert_after(node, down)
        widened += 1
    return widened


def _trace(wrapper: Any, shapes: Shapes, cfg: ExportSpec, device: str, debug: bool, source: str,
           experts: int = 0) -> Any:
    """torch.onnx's program for the wrapper with its weights on `device`, not yet optimized; `experts`:
    how many mixture-of-experts layers it has (their op is translated to com.microsoft.MoE)."""
    import torch

    batch, seq, past, total = (torch.export.Dim(n) for n in ("batch", "seq", "past", "total"))
    dynamic_shapes = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past} for _ in range(2 * shapes.layers)),
    }
    try:
        with _quiet(debug), torch.no_grad(), small_constants_kept():
            return torch.onnx.export(
                wrapper,
                tuple(t.to(device) for t in sample_inputs(shapes, batch=2, seq=3, past=4)),
                input_names=[*INPUTS, *kv_names(shapes.layers, "past_key_values")],
                output_names=["logits", *kv_names(shapes.layers, "present")],
                dynamic_shapes=dynamic_shapes,
                opset_version=cfg.opset,
                dynamo=True,
                optimize=False,
                custom_translation_table=moe.translation_table(dense=cfg.experts == "dense") if experts else None,
                verbose=debug,
            )
    except Exception as exc:  # the exporter raises many unrelated types; all mean the same to a user
        raise _export_error(exc, source) from exc


def _export_error(exc: Exception, source: str) -> ExportError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ExportError(f"torch.onnx export of {source} failed: {first} (rerun with --debug)")


@dataclass(frozen=True)
class StoredTensor:
    offset: int
    dtype: Any  # numpy dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightsFile:
    """A module's parameters and buffers, written one after another to a file, read back one at a time."""

    path: Path
    tensors: dict[str, StoredTensor]  # by name in the module; tied tensors share one entry

    @classmethod
    def written(cls, module: Any, path: Path) -> WeightsFile:
        tensors: dict[str, StoredTensor] = {}
        stored: dict[tuple, StoredTensor] = {}
        with open(path, "wb") as sink:
            for name, tensor in _named_tensors(module):
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                       tuple(tensor.stride()), tensor.dtype)
                if key not in stored:
                    array = tensor.detach().to(_graph_dtype(tensor)).contiguous().numpy()
                    stored[key] = StoredTensor(sink.tell(), array.dtype, array.shape)
                    sink.write(array.data)
                tensors[name] = stored[key]
        return cls(path, tensors)

    def read(self, name: str) -> np.ndarray:
        entry = self.tensors[name]
        return np.fromfile(self.path, entry.dtype, int(np.prod(entry.shape)), offset=entry.offset).reshape(entry.shape)

    def put_back(self, module: Any) -> None:
        """The module's parameters and buffers from this file again, as it was written from them."""
        import torch

        _replace_tensors(module, lambda name, _: torch.from_numpy(self.read(name)))

    def attach(self, model: Any) -> None:
        """Give the graph's initializers their values, read from this file each time they are wanted, never
        kept; a Transpose of one (how the exporter feeds a Linear's weight to MatMul) becomes an initializer
        of its own the same way, as the exporter's optimizer would fold it but without holding the result."""
        import onnx_ir as ir

        graph = model.graph
        for name, value in graph.initializers.items():
            if name in self.tensors:
                value.const_value = self._lazy(name, name)
            elif value.const_value is None or _is_meta(value.const_value):
                raise ValueError(f"initializer {name} has no value outside torch")
        for node in list(graph):
            source = node.inputs[0] if node.op_type == "Transpose" and node.domain == "" and node.inputs else None
            if (source is None or source.name not in self.tensors or source.name not in graph.initializers
                    or source.is_graph_input() or source.is_graph_output() or len(source.uses()) != 1
                    or node.outputs[0].is_graph_output()):
                continue
            rank = len(self.tensors[source.name].shape)
            axes = tuple(node.attributes.get_ints("perm", None) or reversed(range(rank)))  # none: reversed
            output = node.outputs[0]
            folded = ir.Value(name=output.name, shape=output.shape, type=output.type,
                              const_value=self._lazy(source.name, output.name, tuple(axes)))
            ir.convenience.replace_all_uses_with(output, folded)
            graph.remove(node, safe=True)
            graph.initializers.pop(source.name)
            graph.register_initializer(folded)

    def _lazy(self, stored: str, name: str, axes: tuple[int, ...] | None = None) -> Any:
        """An initializer read from the file at each use; with `axes`, transposed by them."""
        import onnx_ir as ir

        entry = self.tensors[stored]
        shape = entry.shape if axes is None else tuple(entry.shape[i] for i in axes)

        def read() -> Any:
            array = self.read(stored)
            return ir.tensor(array if axes is None else np.ascontiguousarray(array.transpose(axes)), name=name)

        return ir.LazyTensor(read, dtype=ir.DataType.from_numpy(entry.dtype), shape=ir.Shape(shape), name=name)


def _named_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _is_meta(tensor: Any) -> bool:
    raw = getattr(tensor, "raw", None)
    return getattr(getattr(raw, "device", None), "type", None) == "meta"


def _graph_dtype(tensor: Any) -> Any:
    """A weight's dtype in the graph: fp32 for floating ones, whatever the checkpoint stores."""
    import torch

    return torch.float32 if tensor.is_floating_point() else tensor.dtype


def _weights_on_meta(module: Any) -> None:
    """Every parameter and buffer on the meta device, in the graph's dtype: their memory freed."""
    import torch

    _replace_tensors(module, lambda _, tensor: torch.empty_like(tensor, device="meta", dtype=_graph_dtype(tensor)))


def _replace_tensors(module: Any, make: Callable[[str, Any], Any]) -> None:
    """Each parameter and buffer of `module` replaced by make(its name, it), a tied one by one
    replacement wherever it is tied (Module.to would make a new Parameter per module)."""
    import torch

    made: dict[int, Any] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    new = make(f"{prefix}.{key}" if prefix else key, tensor)
                    made[id(tensor)] = (torch.nn.Parameter(new, tensor.requires_grad)
                                        if isinstance(tensor, torch.nn.Parameter) else new)
                table[key] = made[id(tensor)]


@contextlib.contextmanager
def small_constants_kept():
    """onnxscript's optimizer (the exporter's, and the optimize stage's) without its `x + 0` / `x - 0`
    rules: they match any constant within 1e-8 of zero, so an RMSNorm epsilon of 1e-8 (Helium's)
    vanished and a zero embedding row (a padding_idx) came out NaN. The rest runs as it is."""
    try:
        from onnxscript import rewriter
        from onnxscript.rewriter.rules.common import _no_op

        default = rewriter._DEFAULT_REWRITE_RULES
        zero_ops = [r for r in _no_op.rules.rules
                    if [n.op_type for n in r._target_pattern._nodes] in (["Add"], ["Sub"])]
    except (ImportError, AttributeError):  # another onnxscript: its rules as they are (validation still checks)
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in default if not any(r is z for z in zero_ops))
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = default
        forget_matched_graphs()


def forget_matched_graphs() -> None:
    """Drop the graph each onnxscript pattern matcher keeps from its last match. The rules are module
    globals, so that graph (every weight in it, and the torch parameters behind an export's) outlived
    the stage: 0.9 GiB of a 135M model's stayed resident through the whole compile."""
    import gc

    try:
        from onnxscript.rewriter._matcher import PatternMatcher
    except ImportError:
        return
    for matcher in (o for o in gc.get_objects() if isinstance(o, PatternMatcher)):
        for name in ("_graph", "_current_node", "_match", "_tracer"):
            if name in vars(matcher):
                setattr(matcher, name, None)


@contextlib.contextmanager
def _quiet(debug: bool):
    """The exporter prints progress lines and warnings meant for torch developers; keep them for --debug."""
    if debug:
        yield
        return
    sink = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
