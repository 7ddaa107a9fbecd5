"""A comparison report written three ways: JSON for machines, Markdown and one self-contained HTML page
for people. Every number a person reads goes through `fmt`, so the three files show the same values.

The HTML page has no external resource (no script, font or stylesheet from anywhere): plots are
inline SVG drawn by matplotlib, so the page opens offline and can be attached to a ticket as is.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
from pathlib import Path
from typing import Any

from .accuracy import GATES, failed_gates
from .compare import worst_prompts

# (label, summary key, format) for the summary table, in reading order.
SUMMARY_ROWS = [
    ("perplexity of A on the held-out text", "perplexity_reference", ".4f"),
    ("perplexity of B on the held-out text", "perplexity", ".4f"),
    ("perplexity change, B against A", "perplexity_change", "+.3%"),
    ("top-1 agreement, teacher-forced (worse of text and prompts)", "top1_agreement", ".4f"),
    ("top-1 agreement on the held-out text", "top1_agreement_text", ".4f"),
    ("top-1 agreement over A's continuations", "top1_agreement_prompts", ".4f"),
    ("greedy exact-match rate", "greedy_match", ".3f"),
    ("KL(A || B) per token, mean", "kl_divergence", ".3e"),
    ("KL(A || B) per token, max", "kl_divergence_max", ".3e"),
    ("max |logit error|", "max_logit_error", ".3e"),
    ("mean |logit error|", "mean_logit_error", ".3e"),
    ("prefill max |logit error|", "prefill_max_logit_error", ".3e"),
    ("prefill mean |logit error|", "prefill_mean_logit_error", ".3e"),
    ("prefill cosine similarity, worst prompt", "prefill_cosine", ".6f"),
    ("prefill cosine similarity, mean", "prefill_cosine_mean", ".6f"),
    ("tokens/s of A (greedy, all prompts in one batch, prefill included)", "tokens_per_second_reference", ".1f"),
    ("tokens/s of B (same run)", "tokens_per_second", ".1f"),
    ("speed ratio B / A", "tokens_per_second_ratio", ".2f"),
]
FORMATS = {key: spec for _, key, spec in SUMMARY_ROWS}
PROMPT_COLUMNS = [("#", "index", "d"), ("top-1", "top1_agreement", ".3f"), ("KL mean", "kl_divergence", ".3e"),
                  ("max |err|", "max_logit_error", ".3e"), ("prefill cosine", "prefill_cosine", ".6f")]


def fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, FORMATS.get(key, ".4g"))


def write_report(report: dict[str, Any], folder: Path, stem: str = "report") -> list[Path]:
    """report.json, report.md and report.html in `folder`; each file appears whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    contents = {"json": json.dumps(report, indent=2) + "\n", "md": markdown(report), "html": html_page(report)}
    paths = []
    for suffix, text in contents.items():
        path = folder / f"{stem}.{suffix}"
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
        paths.append(path)
    return paths


def _gate_rows(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    rows = []
    for gate, threshold in report["gates"].items():
        metric, relation = GATES[gate]
        holds = not failed_gates(report["summary"], {gate: threshold})
        rows.append((f"{gate} {relation} {threshold:g}", metric, fmt(metric, report["summary"][metric]), holds))
    return rows


def _speed_note(report: dict[str, Any]) -> str:
    repeats = report["inputs"]["speed_repeats"]
    return "tokens/s from one timed run each" if repeats == 1 else f"tokens/s: medians of {repeats} interleaved runs"


SENSITIVITY_COLUMNS = ["rank", "module group", "MatMul weights", "KL mean", "KL max", "top-1", "kept"]
ATTEMPT_COLUMNS = ["groups kept", "MatMul weights kept", "top-1", "perplexity change", "result"]


def _sensitivity(report: dict[str, Any]) -> tuple[str, list[list[str]], list[list[str]]] | None:
    """`exclude: auto`'s table, if the variant had one: (a sentence, one row per module group, one row
    per attempt of the search)."""
    found = report.get("exclude_auto")
    if not found:
        return None
    kept, kept_as = set(found["groups_kept"]), found["kept_as"]
    total = sum(r.get("weight_elements", 0) for r in found["sensitivity"]) or 1
    groups = [[str(rank), r["group"], f"{r.get('weight_elements', 0) / total:.1%}",
               fmt("kl_divergence", r["kl_divergence"]), fmt("kl_divergence", r["kl_divergence_max"]),
               fmt("top1_agreement", r["top1_agreement"]), "yes" if r["group"] in kept else ""]
              for rank, r in enumerate(found["sensitivity"], 1)]
    attempts = [[f"{a['groups_kept']}" + (f" ({', '.join(a['groups'])})" if a.get("groups") else ""),
                 f"{a.get('weights_kept', 0):.1%}", fmt("top1_agreement", a["top1_agreement"]),
                 fmt("perplexity_change", a["perplexity_change"]),
                 "pass" if not a["failed_gates"] else "missed " + ", ".join(a["failed_gates"])]
                for a in found["attempts"]]
    outcome = (f"{len(kept)} of {len(groups)} module groups kept {kept_as} "
               f"({found.get('weights_kept', 0):.1%} of the MatMul weights)"
               if found["met_gates"] else f"no count of the {len(groups)} module groups {kept_as} met the gates; "
               "built with none kept")
    if not found["sensitivity"]:
        return ("quantize.exclude: auto. Every module group quantized met the gates at the first attempt: none "
                f"kept {kept_as}, and no per-group ranking measured (it costs a quantized build per group).",
                [], attempts)
    sentence = (f"quantize.exclude: auto. Each module group quantized alone, the rest fp32, against the fp32 graph "
                f"(teacher-forced on the calibration prompts), most sensitive first; kept {kept_as}: the shortest "
                f"prefix that passed, less each group, heaviest first, that it passed without; {outcome}.")
    return sentence, groups, attempts


LAYERWISE_COLUMNS = ["block", "error after it", "added by it"]


def _stream(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A layerwise table's residual stream rows (tables from before the logits row have no `point`)."""
    return [r for r in records if r.get("point", "residual stream") == "residual stream"]


def largest_additions(records: list[dict[str, Any]], count: int = 3) -> str:
    """The `count` blocks of a layerwise table (sensitivity.residual_errors) that added most to the
    residual stream, as `block (+0.48%), ...`: for the compile log and the report alike. The logits row
    is left out: its addition is measured another way (layerwise_ends says it)."""
    largest = sorted(_stream(records), key=lambda r: -r["added"])[:count]
    return ", ".join(f"{r['block']} ({r['added']:+.2%})" for r in largest)


def layerwise_ends(records: list[dict[str, Any]]) -> str:
    """Where a layerwise table ends: `the residual stream ends 2.48% off fp32, the logits 1.76% off
    (lm_head adds +0.36%)`; the logits part only where the table has that row."""
    stream, logits = _stream(records), [r for r in records if r.get("point") == "logits"]
    text = f"the residual stream ends {stream[-1]['relative_error']:.2%} off fp32" if stream else ""
    if logits:
        text += (", the logits " if text else "the logits ") + (
            f"{logits[0]['relative_error']:.2%} off ({logits[0]['block']} adds {logits[0]['added']:+.2%})")
    return text


def _layerwise(report: dict[str, Any]) -> tuple[str, list[list[str]]] | None:
    """The quantized variant's residual stream error after each block, then its logits' error, if it
    has them: (a sentence, rows)."""
    records = report.get("layerwise")
    if not records:
        return None
    sentence = ("Layer by layer: the residual stream after each attention and MLP block, this variant's graph "
                "against its fp32 graph on the calibration prompts (per token |quantized - fp32| / |fp32|, "
                "averaged). The error carried in passes through each block, so a block's addition is what it "
                "adds to that, not its cost alone.")
    if any(r.get("point") == "logits" for r in records):
        sentence += (" The last row is the logits (of each calibration row's last token where the graph "
                     "computes only that one: 8 tokens): the LM head's addition is their error less that of "
                     "the fp32 head on this graph's own head input.")
    sentence += f" In all: {layerwise_ends(records)}. Largest additions to the stream: {largest_additions(records)}."
    return sentence, [[r["block"] + (" -> logits" if r.get("point") == "logits" else ""),
                       f"{r['relative_error']:.2%}", f"{r['added']:+.2%}"] for r in records]


def _verdict(report: dict[str, Any]) -> str:
    if not report["gates"]:
        return "NO GATES (measured only)"
    return "PASS" if report["passed"] else f"FAIL ({len(report['failed_gates'])} of {len(report['gates'])} gates)"


# -- Markdown -------------------------------------------------------------------------------------

def _md_text(text: str) -> str:
    for char in "\\`*_|<>[]":
        text = text.replace(char, "\\" + char)
    return text.replace("\n", " ⏎ ")


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"# Kiln comparison: {_verdict(report)}", "",
             f"- **A (reference):** `{report['a']['label']}`: {report['a']['description']}",
             f"- **B (candidate):** `{report['b']['label']}`: {report['b']['description']}",
             f"- {report['inputs']['prompts']} prompts x {report['inputs']['new_tokens']} new tokens, "
             f"{report['inputs']['text_tokens']} held-out text tokens; {_speed_note(report)}; {report['created']}", ""]
    if report["gates"]:
        lines += ["## Gates", "", "| gate | value | result |", "| --- | --- | --- |"]
        lines += [f"| {g} | {v} | {'pass' if ok else '**FAIL**'} |" for g, _, v, ok in _gate_rows(report)]
        lines.append("")
    lines += ["## Summary", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {label} | {fmt(key, s[key])} |" for label, key, _ in SUMMARY_ROWS]
    table, layerwise = _sensitivity(report), _layerwise(report)
    if table or layerwise:
        lines += ["", "## Where accuracy goes"]
    if table:
        sentence, groups, attempts = table
        lines += ["", sentence, "", "| " + " | ".join(ATTEMPT_COLUMNS) + " |", "|" + " --- |" * len(ATTEMPT_COLUMNS)]
        lines += ["| " + " | ".join(_md_text(c) for c in row) + " |" for row in attempts]
        if groups:
            lines += ["", "| " + " | ".join(SENSITIVITY_COLUMNS) + " |", "|" + " --- |" * len(SENSITIVITY_COLUMNS)]
            lines += ["| " + " | ".join(_md_text(c) for c in row) + " |" for row in groups]
    if layerwise:
        sentence, rows = layerwise
        lines += ["", _md_text(sentence), "", "| " + " | ".join(LAYERWISE_COLUMNS) + " |",
                  "|" + " --- |" * len(LAYERWISE_COLUMNS)]
        lines += ["| " + " | ".join(_md_text(c) for c in row) + " |" for row in rows]
    lines += ["", "## Worst prompts", "",
              "Continuations are greedy; the part after the first differing token is in bold.", ""]
    for p in worst_prompts(report):
        where = "identical" if p["first_divergence"] is None else f"diverge at token {p['first_divergence']}"
        lines += [f"### Prompt {p['index']}: {where}, KL mean {fmt('kl_divergence', p['kl_divergence'])}", "",
                  f"> {_md_text(p['prompt'])}", ""]
        for side, key in (("A", "reference_text"), ("B", "candidate_text")):
            common, rest = _split(p, key)
            lines.append(f"- **{side}:** {_md_text(common)}" + (f"**{_md_text(rest)}**" if rest.strip() else ""))
        lines.append("")
    lines += ["## Every prompt", "", "| " + " | ".join(c for c, _, _ in PROMPT_COLUMNS) + " | first divergence |",
              "| " + " | ".join("---" for _ in range(len(PROMPT_COLUMNS) + 1)) + " |"]
    for p in report["prompts"]:
        cells = [format(p[k], spec) for _, k, spec in PROMPT_COLUMNS]
        lines.append("| " + " | ".join(cells) + f" | {fmt('', p['first_divergence'])} |")
    lines += ["", "Plots of agreement and error per position are in the HTML report beside this file.", ""]
    return "\n".join(lines)


def _split(prompt: dict[str, Any], key: str) -> tuple[str, str]:
    """(shared text, this side's own rest) of a continuation."""
    text, common = prompt[key], prompt["common_text"]
    if prompt["first_divergence"] is None:
        return text, ""
    return (common, text[len(common):]) if text.startswith(common) else ("", text)


# -- HTML -----------------------------------------------------------------------------------------

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ddd; padding: .25em .6em; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #176b2c; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
.verdict { display: inline-block; padding: .2em .7em; border-radius: .3em; color: #fff; }
.verdict.pass { background: #2e7d32; } .verdict.fail { background: #c62828; } .verdict.none { background: #777; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
.pair div { border: 1px solid #ddd; padding: .5em; white-space: pre-wrap; font-family: ui-monospace, monospace; }
mark { background: #ffd54f; } .prompt { color: #555; font-style: italic; }
figure { margin: 1em 0; } svg { max-width: 100%; height: auto; }
"""


def html_page(report: dict[str, Any]) -> str:
    e = html.escape
    s = report["summary"]
    kind = "none" if not report["gates"] else ("pass" if report["passed"] else "fail")
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Kiln comparison: "
             f"{e(_verdict(report))}</title><style>{STYLE}</style></head><body>",
             f"<h1>Kiln comparison <span class='verdict {kind}' id='verdict'>{e(_verdict(report))}</span></h1>",
             "<table>",
             f"<tr><th>A (reference)</th><td><code>{e(report['a']['label'])}</code><br>"
             f"{e(report['a']['description'])}</td></tr>",
             f"<tr><th>B (candidate)</th><td><code>{e(report['b']['label'])}</code><br>"
             f"{e(report['b']['description'])}</td></tr>",
             f"<tr><th>inputs</th><td>{report['inputs']['prompts']} prompts x {report['inputs']['new_tokens']} new "
             f"tokens, {report['inputs']['text_tokens']} held-out text tokens; {_speed_note(report)}; "
             f"{e(report['created'])}</td></tr>",
             "</table>"]
    if report["gates"]:
        parts.append("<h2>Gates</h2><table id='gates'><tr><th>gate</th><th>value</th><th>result</th></tr>")
        for gate, _, value, ok in _gate_rows(report):
            result = "<span class='pass'>pass</span>" if ok else "<span class='fail'>FAIL</span>"
            parts.append(f"<tr><td>{e(gate)}</td><td class='num'>{value}</td><td>{result}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Summary</h2><table id='summary'><tr><th>metric</th><th>value</th></tr>")
    parts += [f"<tr><td>{e(label)}</td><td class='num'>{fmt(key, s[key])}</td></tr>" for label, key, _ in SUMMARY_ROWS]
    parts.append("</table>")
    table, layerwise = _sensitivity(report), _layerwise(report)
    sections: list[tuple[str, list[tuple[str, list[str], list[list[str]]]]]] = []
    if table:
        sentence, groups, attempts = table
        sections.append((sentence, [("attempts", ATTEMPT_COLUMNS, attempts),
                                    ("sensitivity", SENSITIVITY_COLUMNS, groups)]))
    if layerwise:
        sections.append((layerwise[0], [("layerwise", LAYERWISE_COLUMNS, layerwise[1])]))
    if sections:
        parts.append("<h2>Where accuracy goes</h2>")
    for sentence, tables in sections:
        parts.append(f"<p>{e(sentence)}</p>")
        for key, columns, rows in tables:
            if rows:
                parts.append(f"<table id='{key}'><tr>" + "".join(f"<th>{e(c)}</th>" for c in columns) + "</tr>")
                parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
                parts.append("</table>")
    parts.append("<h2>Per position</h2>")
    parts += [f"<figure>{svg}</figure>" for svg in _plots(report)]
    parts.append("<h2>Worst prompts</h2><p>Greedy continuations of A and B; "
                 "<mark>marked</mark> text comes after the first token where they differ.</p>")
    for p in worst_prompts(report):
        where = "identical" if p["first_divergence"] is None else f"diverge at token {p['first_divergence']}"
        parts.append(f"<h3>Prompt {p['index']}: {where}, KL mean {fmt('kl_divergence', p['kl_divergence'])}</h3>"
                     f"<p class='prompt'>{e(p['prompt'])}</p><div class='pair'>")
        for side, key in (("A", "reference_text"), ("B", "candidate_text")):
            common, rest = _split(p, key)
            marked = f"<mark>{e(rest)}</mark>" if rest else ""
            parts.append(f"<div><b>{side}</b>\n{e(common)}{marked}</div>")
        parts.append("</div>")
    header = "".join(f"<th>{e(c)}</th>" for c, _, _ in PROMPT_COLUMNS)
    parts.append(f"<h2>Every prompt</h2><table id='prompts'><tr>{header}<th>first divergence</th><th>prompt</th></tr>")
    for p in report["prompts"]:
        cells = "".join(f"<td class='num'>{format(p[k], spec)}</td>" for _, k, spec in PROMPT_COLUMNS)
        parts.append(f"<tr>{cells}<td class='num'>{fmt('', p['first_divergence'])}</td>"
                     f"<td>{e(p['prompt'][:80])}</td></tr>")
    parts.append("</table></body></html>\n")
    return "\n".join(parts)


def _plots(report: dict[str, Any]) -> list[str]:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend

    positions = report["positions"]
    x = list(range(len(positions["top1_agreement"])))
    agreement = Figure(figsize=(9, 3.2))
    ax = agreement.subplots()
    ax.plot(x, positions["top1_agreement"], marker=".", label="top-1 agreement (teacher-forced)")
    ax.plot(x, [1 - d for d in positions["diverged"]], marker=".", label="share of prompts still matching (greedy)")
    ax.set(xlabel="position in A's continuation", ylabel="share of prompts", ylim=(-0.02, 1.02),
           title="Agreement per position")
    ax.legend(loc="lower left")
    errors = Figure(figsize=(9, 3.2))
    ax = errors.subplots()
    floor = 1e-12  # identical logits would put zeros on a log axis
    for key, label in (("max_logit_error", "max |logit error|"), ("mean_logit_error", "mean |logit error|"),
                       ("kl_divergence", "KL(A || B), mean")):
        ax.plot(x, [max(v, floor) for v in positions[key]], marker=".", label=label)
    ax.set(xlabel="position in A's continuation", yscale="log", title="Logit error and KL per position")
    ax.legend(loc="best")
    return [_svg(agreement), _svg(errors)]


def _svg(figure: Any) -> str:
    figure.set_layout_engine("tight")
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
