"""MkDocs hooks: the parts of the site generated from the library at build time.

* ``<!-- pnn:capabilities -->`` in a page becomes the capability table, from
  ``pnn.capabilities()`` (every registered implementation's own :class:`Support`
  declaration), followed by the backends' availability on the building machine.
* Every ``::: portable_nn.<op>`` directive of a dispatched op is followed by a note
  listing the backends that implement that op, from the same table, so the API
  reference never lags behind the kernels.
* ``<!-- pnn:adapters -->`` becomes one ``:::`` directive per optional adapter module
  whose source exists (``portable_nn.torch``, ``portable_nn.jax``); mkdocstrings reads
  sources statically, so neither PyTorch nor JAX is needed to build the page.
* griffe's docstring-format warnings about the sources in :data:`LENIENT_SOURCES` (none at
  present) are logged as info instead of failing ``mkdocs build --strict``.
* Sphinx roles in docstrings (``:class:`Support```) are rendered as plain code.

Importing this module needs neither mkdocs nor any plugin (tests/test_docs.py imports it).
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

CAPABILITIES = "<!-- pnn:capabilities -->"
ADAPTERS = "<!-- pnn:adapters -->"
GRAD_FIELDS = "<!-- pnn:grad-fields -->"
CAPABILITY_PAGE = "reference/capabilities.md"
_ROOT = Path(__file__).resolve().parents[1]
#: Optional adapter modules, documented when their source file exists.
_ADAPTER_MODULES = ("portable_nn.torch", "portable_nn.jax")
#: Sources whose docstring-format warnings (from griffe) are reported but not fatal, e.g.
#: ``"portable_nn/adapters/jax.py"`` while a new adapter's docstrings settle.  Empty: every
#: source's warnings fail ``mkdocs build --strict``.
LENIENT_SOURCES: tuple[str, ...] = ()
_DIRECTIVE = re.compile(r"^::: portable_nn\.(\w+)[ \t]*$")
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)")
_COLUMNS = ("op", "backend", "arrays", "dtypes", "layouts", "notes", "available")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def capability_table(rows: list[dict[str, str]]) -> str:
    """The capability rows as a Markdown table (op and backend as code)."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for row in rows:
        cells = [f"`{row['op']}`", f"`{row['backend']}`", *(_cell(row[c]) for c in _COLUMNS[2:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def availability_list() -> str:
    """Each backend and whether the machine that built the site can run it, with the reason."""
    import portable_nn as pnn

    items = []
    for name, status in pnn.available_backends().items():
        mark = "available" if status else "not available"
        items.append(f"- `{name}`: {mark} ({status.reason})")
    return "\n".join(items)


def backends_note(op: str, rows: list[dict[str, str]], table_link: str = "capabilities.md") -> str:
    """An admonition listing the implementations of ``op`` from the capability rows."""
    entries = [
        f"`{r['backend']}` ({r['arrays']}; {r['dtypes']}"
        + (f"; layouts {r['layouts']}" if r["layouts"] != "all" else "")
        + ")"
        for r in rows
        if r["op"] == op
    ]
    body = "; ".join(entries) if entries else "none registered"
    return (
        '!!! info "Backends (from `pnn.capabilities()`)"\n\n'
        f"    {body}.  See the [capability table]({table_link}) for notes and availability.\n"
    )


def _insert_backend_notes(markdown: str, rows: list[dict[str, str]], ops: tuple[str, ...], table_link: str) -> str:
    """Put :func:`backends_note` after each op directive (and its indented options block)."""
    lines = markdown.splitlines()
    out: list[str] = []
    pending: str | None = None
    for line in lines:
        if pending is not None and line.strip() and not line[0].isspace():
            out += ["", pending, ""]
            pending = None
        out.append(line)
        match = _DIRECTIVE.match(line)
        if match and match[1] in ops:
            pending = backends_note(match[1], rows, table_link)
    if pending is not None:
        out += ["", pending]
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def adapter_directives(root: Path = _ROOT) -> str:
    """``:::`` directives for the adapter modules present in the source tree."""
    blocks = []
    for module in _ADAPTER_MODULES:
        path = root.joinpath(*module.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            blocks.append(f"::: {module}\n    options:\n      heading_level: 2\n      show_submodules: false")
        else:
            blocks.append(f"*`{module}` is not part of this build yet.*")
    return "\n\n".join(blocks)


def grad_fields_table() -> str:
    """Each dispatched op and the fields of its gradients named tuple, from the ops' specifications."""
    from portable_nn import dispatch
    from portable_nn.api._common import spec_of

    lines = ["| op | `pullback(...)` fields |", "|---|---|"]
    for op in dispatch.op_names():
        fields = ", ".join(f"`{name}`" for name in spec_of(op).grad_fields)
        lines.append(f"| `{op}` | {fields} |")
    return "\n".join(lines)


def render(markdown: str, src_uri: str) -> str:
    """The Markdown of the page at ``src_uri`` (relative to docs/) with every generated part filled in."""
    import portable_nn as pnn
    from portable_nn import dispatch

    rows = pnn.capabilities()
    if CAPABILITIES in markdown:
        generated = capability_table(rows) + "\n\nBackends on the machine that built this page:\n\n"
        markdown = markdown.replace(CAPABILITIES, generated + availability_list())
    if GRAD_FIELDS in markdown:
        markdown = markdown.replace(GRAD_FIELDS, grad_fields_table())
    if ADAPTERS in markdown:
        markdown = markdown.replace(ADAPTERS, adapter_directives())
    if ":::" in markdown:
        table_link = posixpath.relpath(CAPABILITY_PAGE, posixpath.dirname(src_uri) or ".")
        markdown = _insert_backend_notes(markdown, rows, dispatch.op_names(), table_link)
    return markdown


def strip_roles(html: str) -> str:
    """``:class:<code>X</code>`` (a Sphinx role rendered by Markdown) as ``<code>X</code>``."""
    return _ROLE.sub("", html)


class _LenientSources(logging.Filter):
    """Turns griffe's docstring-format warnings about :data:`LENIENT_SOURCES` into info messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and any(src in record.getMessage() for src in LENIENT_SOURCES):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def lenient_griffe_warnings() -> None:
    """Install :class:`_LenientSources` on the logger mkdocstrings gives griffe (once)."""
    logger = logging.getLogger("mkdocs.plugins.griffe")
    if not any(isinstance(f, _LenientSources) for f in logger.filters):
        logger.addFilter(_LenientSources())


# --------------------------------------------------------------------------- mkdocs events


def on_config(config: Any, **kwargs: Any) -> Any:
    lenient_griffe_warnings()
    return config



def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return render(markdown, page.file.src_uri)


def on_page_content(html: str, **kwargs: Any) -> str:
    return strip_roles(html)
