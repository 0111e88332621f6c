"""What was alive at the peak or the OOM: a treemap (category, module, tensor) and tables."""
from __future__ import annotations

from memdoctor.attribution import module_of, source_label
from memdoctor.report.html.escape import esc, plot_text
from memdoctor.report.html.page import Page
from memdoctor.report.html.style import CATEGORY_COLORS
from memdoctor.run import CATEGORIES, Block, Run
from memdoctor.units import format_bytes

TREE_MODULES = 25              # modules per category in the treemap, the rest summed
TREE_TENSORS = 12              # tensors per module in the treemap, the rest summed
TOP_TENSORS = 15


def _live_at(run: Run, seq: int) -> list[Block]:
    return [b for b in run.blocks.values() if b.alloc_seq <= seq and (b.free_seq is None or b.free_seq > seq)]


def _module_label(mod: str | None) -> str:
    return "(outside modules)" if mod is None else "(root)" if mod == "" else mod


def _tensor_detail(b: Block) -> str:
    shape = "×".join(map(str, b.shape)) if b.shape else "()"
    return f"{shape} {b.dtype}".strip() + f" · {b.phase}, step {b.step}"


def _treemap(blocks: list[Block], title: str) -> tuple[list, dict]:
    by_cat: dict[str, dict[str, list[Block]]] = {}
    for b in blocks:
        by_cat.setdefault(b.category, {}).setdefault(_module_label(module_of(b)), []).append(b)
    ids, parents, labels, values, colors, custom = [], [], [], [], [], []
    total = sum(b.nbytes for b in blocks)

    def node(i, parent, label, value, color, info):
        ids.append(i)
        parents.append(parent)
        labels.append(label)
        values.append(int(value))
        colors.append(color)
        custom.append([format_bytes(value), info])

    node("all", "", f"alive: {format_bytes(total)}", total, "#ffffff", f"{len(blocks):,} tensors")
    order = [c for c in CATEGORIES if c in by_cat] + [c for c in by_cat if c not in CATEGORIES]
    for ci, cat in enumerate(order):
        mods = by_cat[cat]
        color = CATEGORY_COLORS.get(cat, "#bab0ac")
        cat_total = sum(b.nbytes for bs in mods.values() for b in bs)
        if cat_total <= 0:
            continue
        cid = f"c{ci}"
        node(cid, "all", plot_text(cat), cat_total, color, f"category · {sum(len(v) for v in mods.values()):,} tensors")
        ranked = sorted(mods.items(), key=lambda kv: -sum(b.nbytes for b in kv[1]))
        shown, rest = ranked[:TREE_MODULES], ranked[TREE_MODULES:]
        for mi, (mod, bs) in enumerate(shown):
            mid = f"{cid}/m{mi}"
            mod_total = sum(b.nbytes for b in bs)
            if mod_total <= 0:
                continue
            label = mod if mod.startswith("(") else f"module {mod}"
            node(mid, cid, plot_text(label), mod_total, color, f"module · {len(bs):,} tensors")
            bs = sorted(bs, key=lambda b: -b.nbytes)
            for ti, b in enumerate(bs[:TREE_TENSORS]):
                if b.nbytes > 0:
                    shape = "×".join(map(str, b.shape)) if b.shape else ""
                    node(f"{mid}/t{ti}", mid, plot_text(f"{b.name or '?'} {shape}".strip(), 70), b.nbytes, color,
                         plot_text(_tensor_detail(b)))
            more = bs[TREE_TENSORS:]
            more_bytes = sum(b.nbytes for b in more)
            if more_bytes > 0:
                node(f"{mid}/more", mid, f"({len(more):,} more tensors)", more_bytes, color, "smaller tensors")
        rest_bytes = sum(b.nbytes for _, bs in rest for b in bs)
        if rest_bytes > 0:
            node(f"{cid}/more", cid, f"({len(rest):,} more modules)", rest_bytes, color, "smaller modules")
    data = [{"type": "treemap", "ids": ids, "parents": parents, "labels": labels, "values": values,
             "branchvalues": "total", "marker": {"colors": colors, "line": {"color": "#fff", "width": 1}},
             "customdata": custom, "maxdepth": -1,
             "texttemplate": "<b>%{label}</b><br>%{customdata[0]}",
             "hovertemplate": "<b>%{label}</b><br>%{customdata[0]} (%{percentRoot:.1%})<br>%{customdata[1]}"
                              "<extra></extra>", "textinfo": "label+value"}]
    layout = {"title": {"text": title}, "margin": {"l": 10, "r": 10, "t": 50, "b": 10}}
    return data, layout


def alive_section(page: Page, run: Run, focus_seq: int) -> str:
    blocks = _live_at(run, focus_seq) if run.num_events else []
    where = "at the OOM" if run.ooms else "at the peak"
    mark = run.mark_at(focus_seq)
    when = f"event {focus_seq:,}" + (f", {mark.phase} of step {mark.step}" if mark else "")
    total = sum(b.nbytes for b in blocks)
    by_cat = {k: 0 for k in CATEGORIES}
    for b in blocks:
        by_cat[b.category] = by_cat.get(b.category, 0) + b.nbytes
    cat_rows = "".join(
        f"<tr><td><span class=\"swatch\" style=\"background:{CATEGORY_COLORS.get(k, '#bab0ac')}\"></span>{esc(k)}"
        f"</td><td class=\"num\">{esc(format_bytes(v))}</td><td class=\"num\">{100 * v / (total or 1):.1f}%</td></tr>"
        for k, v in by_cat.items() if v)
    cat_table = (f"<table class=\"cats\"><thead><tr><th>category</th><th>bytes</th><th>share</th></tr></thead>"
                 f"<tbody>{cat_rows}<tr class=\"total\"><td>total</td><td class=\"num\">{esc(format_bytes(total))}"
                 f"</td><td></td></tr></tbody></table>")
    top = sorted(blocks, key=lambda b: -b.nbytes)[:TOP_TENSORS]
    trs = "".join(
        f"<tr><td>{esc(b.name or '?')}</td><td>{esc(b.category)}</td><td class=\"num\">{esc(format_bytes(b.nbytes))}"
        f"</td><td>{esc('×'.join(map(str, b.shape)) if b.shape else '()')}</td><td>{esc(b.dtype)}</td>"
        f"<td>{esc(_module_label(module_of(b)))}</td><td>{esc(b.phase)}</td><td class=\"num\">{b.step}</td>"
        f"<td>{esc(source_label(run, b.source))}</td></tr>"
        for b in top)
    top_table = ("<table class=\"tensors\"><thead><tr><th>tensor</th><th>category</th><th>bytes</th><th>shape</th>"
                 "<th>dtype</th><th>module</th><th>made in</th><th>step</th><th>line</th></tr></thead>"
                 f"<tbody>{trs}</tbody></table>")
    fig = ""
    if blocks:
        data, layout = _treemap(blocks, f"alive {where} ({when}): category → module → tensor")
        fig = page.figure(data, layout, height=560)
    return (f"<section id=\"alive\"><h2>What was alive {where}</h2><p class=\"note\">{esc(when)}; "
            f"{len(blocks):,} tensors, {esc(format_bytes(total))}. Click a box to zoom in.</p>{fig}"
            f"<div class=\"cols\"><div>{cat_table}</div><div class=\"grow\"><h3>largest tensors</h3>{top_table}"
            "</div></div></section>")
