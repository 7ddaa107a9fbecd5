"""A decode step's attention alone: Kiln's attention op over long KV caches, builds of the kernel library
side by side in one run, to measure a change to runtime/kernels/attention.c before and after.

    python bench/attention.py [LIBRARY.so ...] [--cache int8 fp16 fp32] [--batch 8] [--context 1500]
                              [--layers 30] [--rounds 9] [--threads 2] [--output bench/results/attention.json]

e.g. the library built from the commit before a change (copied aside) and the one in the tree (the
default, runtime/_cpu_kernels*.so). SmolLM2's shapes (9 query heads, 3 KV heads, head size 64, rotary):
a step of `batch` rows, one new token each after `context` cached tokens, run over `layers` separate
caches one after another as a model's layers are, so that the caches together outgrow the CPU's caches
as a real step's do (30 layers of an int8 cache at batch 8 and 1,500 tokens: 173 MB). Each round runs
every library once, in turn (the order reversed every other round); a cell is the median over rounds, in
ms a step (all layers), keyed by the library's position and path. Writes JSON and
prints a Markdown table with each library's speed-up over the first."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, HEAD_SIZE = 9, 3, 64
CACHE_TYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}


def session(library: Path, cache: str, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from runtime import cpu_kernels

    op = {"fp32": cpu_kernels.ATTENTION_OP, "fp16": cpu_kernels.ATTENTION_FP16_CACHE_OP,
          "int8": cpu_kernels.ATTENTION_INT8_CACHE_OP}[cache]
    kv_type = helper.np_dtype_to_tensor_dtype(np.dtype(CACHE_TYPES[cache]))
    width = HEAD_SIZE * 5 // 4 if cache == "int8" else HEAD_SIZE
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT, ["b", "s", (HEADS + 2 * KV_HEADS) * HEAD_SIZE])]
    inputs += [helper.make_tensor_value_info(n, kv_type, ["b", KV_HEADS, "slots", width])
               for n in ("past_key", "past_value")]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
               helper.make_tensor_value_info("total", TensorProto.INT32, []),
               helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["p", HEAD_SIZE // 2]),
               helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["p", HEAD_SIZE // 2])]
    node = helper.make_node(op, ["query", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
                            ["out", "present_key", "present_value"], domain=cpu_kernels.DOMAIN,
                            num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    outputs += [helper.make_tensor_value_info(n, kv_type, None) for n in ("present_key", "present_value")]
    model = helper.make_model(helper.make_graph([node], "attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(cpu_kernels.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def caches(cache: str, batch: int, slots: int, layers: int, rng) -> list[dict[str, np.ndarray]]:
    """Each layer's past keys and values: numbers of a plausible size (an int8 cache's codes and scales as
    its op stores them: a scale a block of 16)."""
    def one() -> np.ndarray:
        x = rng.standard_normal((batch, KV_HEADS, slots, HEAD_SIZE), np.float32)
        if cache != "int8":
            return x.astype(CACHE_TYPES[cache])
        blocks = x.reshape(*x.shape[:-1], -1, 16)
        largest = np.abs(blocks).max(-1, keepdims=True)
        codes = np.rint(blocks * (127 / largest)).astype(np.int8).reshape(x.shape)
        scales = np.ascontiguousarray((largest[..., 0] / 127).astype(np.float32)).view(np.int8)
        return np.concatenate([codes, scales], axis=-1)

    return [{"past_key": one(), "past_value": one()} for _ in range(layers)]


def bound_steps(sess, layer_caches: list[dict[str, np.ndarray]], feeds: dict[str, np.ndarray]) -> list:
    """An IOBinding a layer, its cache bound as past and present alike (written in place, as the runtime binds it)."""
    import onnxruntime as ort

    bindings = []
    for layer in layer_caches:
        binding = sess.io_binding()
        values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in layer.items()}
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("out")
        binding.bind_ortvalue_output("present_key", values["past_key"])
        binding.bind_ortvalue_output("present_value", values["past_value"])
        bindings.append((binding, values))
    return bindings


def main() -> None:
    from runtime import cpu_kernels

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="*", type=Path, help="kernel libraries (default: the tree's)")
    parser.add_argument("--cache", nargs="+", choices=list(CACHE_TYPES), default=["int8"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "attention.json")
    args = parser.parse_args()
    libraries = args.libraries or [cpu_kernels.library()[0]]
    for library in libraries:
        if library is None or not Path(library).is_file():
            raise SystemExit(f"error: no kernel library at {library} (build it: python setup.py build_ext --inplace)")
    rng = np.random.default_rng(0)
    slots = args.context + 16
    angles = rng.uniform(0, 2 * np.pi, (slots, HEAD_SIZE // 2)).astype(np.float32)
    feeds = {"query": rng.standard_normal((args.batch, 1, (HEADS + 2 * KV_HEADS) * HEAD_SIZE), np.float32),
             "seqlens_k": np.full(args.batch, args.context, np.int32),
             "total": np.array(args.context + 1, np.int32), "cos": np.cos(angles), "sin": np.sin(angles)}
    results: dict = {}
    for cache in args.cache:
        layer_caches = caches(cache, args.batch, slots, args.layers, rng)
        runs = []
        for library in libraries:
            sess = session(Path(library), cache, args.threads)
            # each library writes its new token into copies of the same caches
            runs.append((sess, bound_steps(sess, [{k: v.copy() for k, v in c.items()} for c in layer_caches], feeds)))
        times: list[list[float]] = [[] for _ in libraries]
        for round_number in range(args.rounds + 1):
            order = range(len(runs)) if round_number % 2 else reversed(range(len(runs)))  # neither always first
            for index in order:
                sess, steps = runs[index]
                start = time.perf_counter()
                for binding, _ in steps:
                    sess.run_with_iobinding(binding)
                if round_number:  # the first round faults the pages in
                    times[index].append(time.perf_counter() - start)
        # keyed by position too: the same file may be given twice (to see the run's noise)
        results[cache] = {f"{number}: {library}": statistics.median(t) * 1000
                          for number, (library, t) in enumerate(zip(libraries, times, strict=True), 1)}
    report = {"batch": args.batch, "context": args.context, "layers": args.layers, "threads": args.threads,
              "rounds": args.rounds, "ms_per_step": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"batch {args.batch}, {args.context} cached tokens, {args.layers} layers, {args.threads} threads; "
          f"ms a step, median of {args.rounds}")
    print("| cache | library | ms a step | speed-up |\n| --- | --- | ---: | ---: |")
    for cache, by_library in results.items():
        first = next(iter(by_library.values()))
        for library, ms in by_library.items():
            print(f"| {cache} | {library} | {ms:.1f} | {first / ms:.2f}x |")


if __name__ == "__main__":
    main()
