"""The Modules tab: the model's modules as a tree, each with the bytes it holds at the peak,
and the highlighted module's bytes by category."""
from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static, TabPane, Tree

from memdoctor.tui.widgets import CATEGORY_STYLE
from memdoctor.units import format_bytes


def nest(modules: dict[str, dict[str, int]]) -> tuple[dict[str, Any], dict[str, int]]:
    """Module path -> category -> bytes, as a tree: {name: {"_children", "_own", "_sums"}}
    (_own: what the module holds outside its children, _sums: with them), and the sums of
    the whole model."""
    nested: dict[str, Any] = {}
    for key, cats in modules.items():
        parts = [key] if key.startswith("(") else key.split(".")
        node = nested
        for part in parts:
            node = node.setdefault(part, {"_children": {}, "_own": {}})
            last = node
            node = node["_children"]
        for c, n in cats.items():
            last["_own"][c] = last["_own"].get(c, 0) + n

    def totals(entry: dict) -> dict[str, int]:
        sums = dict(entry["_own"])
        for child in entry["_children"].values():
            for c, n in totals(child).items():
                sums[c] = sums.get(c, 0) + n
        entry["_sums"] = sums
        return sums

    grand: dict[str, int] = {}
    for entry in nested.values():
        for c, n in totals(entry).items():
            grand[c] = grand.get(c, 0) + n
    return nested, grand


class ModulesPane(TabPane):
    """The tree loads until the tensors' modules are read; each node's data is (path,
    category -> bytes)."""

    TAB_ID, TAB_TITLE = "modules", "3 Modules"

    def __init__(self) -> None:
        super().__init__(self.TAB_TITLE, id=self.TAB_ID)

    def compose(self) -> ComposeResult:
        yield Tree("modules", id="mod-tree")
        yield Static(id="mod-detail")

    def on_mount(self) -> None:
        self.query_one("#mod-tree", Tree).loading = True

    @property
    def focus_target(self) -> Widget:
        return self.query_one("#mod-tree")

    def show(self, modules: dict[str, dict[str, int]]) -> None:
        tree = self.query_one("#mod-tree", Tree)
        tree.loading = False
        tree.clear()
        nested, grand = nest(modules)
        peak = sum(grand.values()) or 1
        tree.root.set_label(Text.assemble(("at the peak ", "bold"), format_bytes(sum(grand.values()))))
        tree.root.data = ("model", grand)

        def add(parent, children: dict, prefix: str) -> None:
            for name, entry in sorted(children.items(), key=lambda kv: -sum(kv[1]["_sums"].values())):
                total = sum(entry["_sums"].values())
                path = f"{prefix}.{name}" if prefix else name
                label = Text.assemble((name, "bold"), "  ", format_bytes(total),
                                      (f"  {100 * total / peak:.0f}%", "dim"))
                if entry["_children"]:
                    node = parent.add(label, data=(path, entry["_sums"]))
                    add(node, entry["_children"], path)
                    own = sum(entry["_own"].values())
                    if own:            # what the module holds outside its children
                        node.add_leaf(Text.assemble(("(itself)", "italic"), "  ", format_bytes(own),
                                                    (f"  {100 * own / peak:.0f}%", "dim")),
                                      data=(f"{path} (itself)", entry["_own"]))
                else:
                    parent.add_leaf(label, data=(path, entry["_sums"]))

        add(tree.root, nested, "")
        tree.root.expand()
        for child in tree.root.children:
            child.expand()
        self._render_detail(tree.root.data)

    def show_error(self, line: Text) -> None:
        tree = self.query_one("#mod-tree", Tree)
        if tree.loading:
            tree.loading = False
            tree.root.set_label(line)

    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        if event.node.data:
            self._render_detail(event.node.data)

    def _render_detail(self, data) -> None:
        path, sums = data
        parts = [Text(path, style="bold"), Text(f" {format_bytes(sum(sums.values()))}: ")]
        shown = [(c, n) for c, n in sorted(sums.items(), key=lambda kv: -kv[1]) if n]
        for i, (c, n) in enumerate(shown):
            parts.append(Text(f"{c} {format_bytes(n)}", style=CATEGORY_STYLE.get(c, "")))
            if i < len(shown) - 1:
                parts.append(Text(", "))
        self.query_one("#mod-detail", Static).update(Text.assemble(*parts))
