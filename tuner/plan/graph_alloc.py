"""The compute buffer as llama.cpp sizes it: a compute graph of tensor shapes, and ggml's graph allocator run over it.

Pure, like tuner.plan.memory: no I/O. llama.cpp reserves its compute buffer by building the worst-case graph (one
ubatch of ``min(n_ctx, n_ubatch)`` tokens, every one an output) and letting ``ggml_gallocr`` place every
intermediate tensor in one buffer; the buffer is the allocator's high-water mark (``llama_context::sched_reserve``
→ ``graph_reserve`` → ``ggml_backend_sched_reserve`` → ``ggml_gallocr_reserve_n``). The high-water mark depends on
the order of the nodes, on which tensors are computed in place, and on which free block each new tensor lands
in, so no closed formula follows it across architectures and ubatches. This module repeats that computation on
shapes alone: :class:`Graph` mirrors ``ggml_build_forward_expand`` (depth-first over sources, leaves apart),
the op helpers mirror ggml's shape rules and views, and :func:`reserve_bytes` mirrors ``ggml-alloc.c``
(inputs first, in-place reuse of a parent's memory, frees at the last consumer, best-fit over free blocks).
The graphs themselves are in tuner.plan.graph_arch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

F32, F16, I32, I64 = 4, 2, 4, 8  # element sizes in bytes; the types the compute graphs use
TENSOR_ALIGNMENT = 32  # ggml-impl.h; the CPU buffer type's alignment
# ggml_op_can_inplace (ggml-alloc.c): ops whose result may take a dying parent's memory.
INPLACE_OPS = frozenset({"FILL", "SCALE", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV", "SQR", "SQRT", "LOG",
                         "UNARY", "ROPE", "RMS_NORM", "CLAMP", "SOFT_MAX"})
VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})


class Tensor:
    """A ggml tensor's shape, strides, op and sources; ``external`` when its data lives elsewhere (weights, cache)."""

    __slots__ = ("ne", "es", "nb", "op", "src", "view_src", "external", "is_input", "is_output",
                 "n_children", "n_views", "allocated", "offset", "host", "copy_bytes")

    def __init__(self, ne: Sequence[int], es: int, op: str = "NONE", src: Sequence[Tensor] = (),
                 nb: Sequence[int] | None = None, view_src: Tensor | None = None, external: bool = False,
                 is_input: bool = False) -> None:
        self.ne = tuple(ne) + (1,) * (4 - len(ne))
        self.es = es
        self.nb = tuple(nb) if nb is not None else _contiguous(self.ne, es)
        self.op, self.src, self.view_src = op, tuple(src), view_src
        self.external, self.is_input, self.is_output = external, is_input, False
        self.n_children = self.n_views = 0
        self.allocated = False
        self.offset = 0
        self.host = False  # placed on the CPU backend beside a GPU (tuner.plan.graph_arch's split graph)
        self.copy_bytes = 0  # a host weight: what its copy in the GPU buffer takes

    @property
    def nbytes(self) -> int:
        """``ggml_nbytes`` for one-element blocks: the last element's offset plus its size."""
        if any(n <= 0 for n in self.ne):
            return 0
        return self.es + sum((n - 1) * b for n, b in zip(self.ne, self.nb, strict=True))

    @property
    def is_view(self) -> bool:
        return self.view_src is not None


def _contiguous(ne: tuple[int, ...], es: int) -> tuple[int, int, int, int]:
    nb = [es]
    for n in ne[:3]:
        nb.append(nb[-1] * n)
    return nb[0], nb[1], nb[2], nb[3]


# --- tensors and ops (ggml.c's shape rules) ---------------------------------------------------------------------


def weight(*ne: int) -> Tensor:
    return Tensor(ne, F32, external=True)


def cache(*ne: int, es: int = F16) -> Tensor:
    return Tensor(ne, es, external=True)


def inp(*ne: int, es: int = F32) -> Tensor:
    return Tensor(ne, es, is_input=True)


def new(op: str, ne: Sequence[int], src: Sequence[Tensor], es: int = F32) -> Tensor:
    return Tensor(ne, es, op, src)


def view(a: Tensor, ne: Sequence[int], nb: Sequence[int] | None = None, op: str = "VIEW") -> Tensor:
    base = a.view_src or a
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    if nb is None:
        strides = _contiguous(ne4, a.es)
    else:
        given = list(nb)[: len(ne) - 1]
        strides = _fill_strides(ne4, (a.es, *given, *((0,) * (3 - len(given)))))
    return Tensor(ne4, a.es, op, (a,), strides, view_src=base)


def _fill_strides(ne: tuple[int, ...], nb: tuple[int, ...]) -> tuple[int, int, int, int]:
    out = list(nb)
    for i in range(1, 4):
        if out[i] == 0:
            out[i] = out[i - 1] * ne[i - 1]
    return out[0], out[1], out[2], out[3]


def reshape(a: Tensor, *ne: int) -> Tensor:
    return view(a, ne, op="RESHAPE")


def permute(a: Tensor, axes: tuple[int, int, int, int]) -> Tensor:
    ne, nb = [0] * 4, [0] * 4
    for i, ax in enumerate(axes):
        ne[ax], nb[ax] = a.ne[i], a.nb[i]
    return Tensor(ne, a.es, "PERMUTE", (a,), nb, view_src=a.view_src or a)


def transpose(a: Tensor) -> Tensor:
    t = permute(a, (1, 0, 2, 3))
    t.op = "TRANSPOSE"
    return t


def same_shape(op: str, a: Tensor, *rest: Tensor | None) -> Tensor:
    """An elementwise op (``ggml_dup_tensor`` of ``a``): ``a``'s shape and type, contiguous."""
    return new(op, a.ne, (a, *(r for r in rest if r is not None)), a.es)


def mul_mat(w: Tensor, x: Tensor) -> Tensor:
    return new("MUL_MAT", (w.ne[1], x.ne[1], x.ne[2], x.ne[3]), (w, x))


def mul_mat_id(w: Tensor, x: Tensor, ids: Tensor) -> Tensor:
    return new("MUL_MAT_ID", (w.ne[1], ids.ne[0], x.ne[2], 1), (w, x, ids))


def get_rows(a: Tensor, rows: Tensor) -> Tensor:
    return new("GET_ROWS", (a.ne[0], rows.ne[0], rows.ne[1], rows.ne[2]), (a, rows))


def cont(a: Tensor, *ne: int) -> Tensor:
    return new("CONT", ne or a.ne, (a,), a.es)


def glu(a: Tensor, b: Tensor) -> Tensor:
    return new("GLU", a.ne, (a, b))


def argsort_top_k(a: Tensor, k: int) -> Tensor:
    order = new("ARGSORT", a.ne, (a,), I32)
    return view(order, (k, a.ne[1], a.ne[2], a.ne[3]), order.nb[1:])


def sum_rows(a: Tensor) -> Tensor:
    return new("SUM_ROWS", (1, a.ne[1], a.ne[2], a.ne[3]), (a,))


def soft_max(a: Tensor, mask: Tensor | None = None, sinks: Tensor | None = None) -> Tensor:
    return same_shape("SOFT_MAX", a, mask, sinks)


def flash_attn(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor | None) -> Tensor:
    src = (q, k, v, mask) + ((sinks,) if sinks is not None else ())
    return new("FLASH_ATTN_EXT", (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), src)


def into(op: str, dst: Tensor, src: Sequence[Tensor]) -> Tensor:
    """SET_ROWS / CPY / an ``_inplace`` op: the result is a view of ``dst`` (nothing allocated); ``src`` in ggml's
    order (``ggml_set_rows``: values, indices, destination; ``ggml_cpy``: source, destination)."""
    return Tensor(dst.ne, dst.es, op, src, dst.nb, view_src=dst.view_src or dst)


def concat(a: Tensor, b: Tensor, dim: int) -> Tensor:
    ne = [x + (y if i == dim else 0) for i, (x, y) in enumerate(zip(a.ne, b.ne, strict=True))]
    return new("CONCAT", ne, (a, b), a.es)


def repeat(a: Tensor, *ne: int) -> Tensor:
    return new("REPEAT", ne, (a,), a.es)


# --- the graph and the allocator ---------------------------------------------------------------------------------


class Graph:
    """``ggml_cgraph``: nodes in the order ``ggml_build_forward_expand`` visits them (sources first, src[0] before
    src[1]), leaves (tensors without an op) apart in the order first seen."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()
        # A backend's allocation dependencies (``ggml_backend_graph_optimize_params::add_alloc_dep``): id of the
        # ``until`` node → the nodes whose sources stay allocated until it is computed (ggml_backend_sched_split_graph
        # adds a GGML_OP_NONE node right after it with them as sources). The backend looks at the split graph, so a
        # source is whatever the node reads once pass 5 has put copies in: resolved when the graph is placed.
        self.deps: dict[int, list[Tensor]] = {}

    def keep_sources_until(self, until: Tensor, *readers: Tensor) -> None:
        self.deps.setdefault(id(until), []).extend(readers)

    def kept(self, node: Tensor) -> list[Tensor]:
        out: list[Tensor] = []
        for r in self.deps.get(id(node), ()):
            out.extend(s for s in r.src if all(s is not k for k in out))
        return out

    def expand(self, *tensors: Tensor) -> None:
        for t in tensors:
            self._visit(t)

    def _visit(self, root: Tensor) -> None:
        if id(root) in self._seen:
            return
        stack: list[tuple[Tensor, int]] = [(root, 0)]
        self._seen.add(id(root))
        while stack:
            t, i = stack.pop()
            if i < len(t.src):
                stack.append((t, i + 1))
                s = t.src[i]
                if id(s) not in self._seen:
                    self._seen.add(id(s))
                    stack.append((s, 0))
                continue
            (self.leafs if t.op == "NONE" else self.nodes).append(t)


class _FreeBlocks:
    """``ggml_dyn_tallocr`` with one chunk: free blocks sorted by offset, the last one open-ended."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, 1 << 62]]
        self.max_size = 0

    def _align(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def alloc(self, size: int) -> int:
        size = self._align(size)
        best, best_size = -1, 1 << 63
        for i in range(len(self.blocks) - 1):  # best fit among the holes; ties go to the later block
            s = self.blocks[i][1]
            if size <= s <= best_size:
                best, best_size = i, s
        if best < 0:
            best = len(self.blocks) - 1
        block = self.blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.blocks[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        size = self._align(size)
        blocks = self.blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:
                block[1] += size
                if i + 1 < len(blocks) and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        pos = next((i for i, b in enumerate(blocks) if b[0] >= offset), len(blocks))
        blocks.insert(pos, [offset, size])


def reserve_bytes(graph: Graph, alignment: int = TENSOR_ALIGNMENT) -> int:
    """The buffer ``ggml_gallocr_reserve_n`` sizes for ``graph`` (``ggml_gallocr_alloc_graph_impl``)."""
    return reserve(graph, alignment)[0]


def reserve(graph: Graph, alignment: int = TENSOR_ALIGNMENT) -> tuple[int, int]:
    """(the buffer ``ggml_gallocr_reserve_n`` sizes for ``graph``'s device nodes, the one for its host nodes).

    Without ``host`` tensors everything is one buffer (the CPU backend alone) and the second figure is 0. With them
    the graph is the one ``ggml_backend_sched_split_graph`` hands the allocator beside a GPU (:func:`_split`): a
    node that reads a tensor of the other backend reads its copy, allocated where the split that first reads it
    starts; the original has one more reader there (``input_dep``). ``graph.deps`` keeps tensors alive as a
    backend's fusions ask. The graph's sources are rewritten to the copies, as the engine rewrites them."""
    mem, host_mem = _FreeBlocks(alignment), _FreeBlocks(alignment)

    def allocate(t: Tensor) -> None:
        if t.external or t.allocated or t.is_view:
            return
        t.allocated = True
        if t.op in INPLACE_OPS:
            for p in t.src:
                if (p.allocated and not p.is_output and p.n_children == 1 and p.n_views == 0 and p.host == t.host
                        and p.es == t.es and p.ne == t.ne and p.nb == t.nb):
                    t.offset = p.offset  # ggml_gallocr_allocate_node: reuse the parent (same layout, no extra)
                    p.allocated = False
                    return
        t.offset = (host_mem if t.host else mem).alloc(t.nbytes)

    def release(t: Tensor) -> None:
        if not t.is_output:
            (host_mem if t.host else mem).free(t.offset, t.nbytes)
            t.allocated = False

    def consumed(p: Tensor) -> None:
        """``ggml_gallocr_alloc_graph_impl``'s "update parents": one reader fewer; freed after its last."""
        p.n_children -= 1
        if p.n_children == 0 and p.n_views == 0:
            if p.is_view:
                base = p.view_src
                assert base is not None
                base.n_views -= 1
                if base.n_views == 0 and base.n_children == 0 and base.allocated:
                    release(base)
            elif p.allocated:
                release(p)

    starts = _split(graph.nodes)
    for leaf in graph.leafs:
        allocate(leaf)
    for i, node in enumerate(graph.nodes):
        for orig, _ in starts.get(i, ()):
            orig.n_children += 1  # input_dep: the original is read where its copy is made
        if node.is_view and node.op != "NONE":
            node.view_src.n_views += 1  # type: ignore[union-attr]
        if node.is_input:
            allocate(node)
        for k in graph.kept(node):
            k.n_children += 1  # the dependency node reads them
        for s in node.src:
            s.n_children += 1
            if s.is_input:
                allocate(s)
    for i, node in enumerate(graph.nodes):
        for orig, copy in starts.get(i, ()):  # graph_copy: input_dep, then the input's copy, at the split start
            allocate(orig)
            consumed(orig)
            allocate(copy)
        for s in node.src:
            allocate(s)
        allocate(node)
        for p in node.src:
            consumed(p)
        for k in graph.kept(node):  # the dependency node, computed right after ``node``
            consumed(k)
    return mem.max_size, host_mem.max_size


def _on_host(t: Tensor) -> bool:
    """The backend a tensor lives on; a view lives on its source's (``ggml_backend_sched_split_graph`` pass 4)."""
    return (t.view_src or t).host


def _split(nodes: Sequence[Tensor]) -> dict[int, list[tuple[Tensor, Tensor]]]:
    """``ggml_backend_sched_split_graph``'s pass 5 on a GPU and the host: the index of the node each split starts at →
    (original, copy) for each tensor of the other backend the split reads, in the order found (activations both
    ways, and host weights the device reads under op offload, copied as ``copy_bytes``). A split starts where the
    backend changes, and at a device node reading a host weight once the split already has inputs. A tensor is
    copied once per backend for the whole graph (``tensor_id_copy``), and every later reader there reads that
    copy: the nodes' sources are rewritten. View ops neither start a split nor read."""
    out: dict[int, list[tuple[Tensor, Tensor]]] = {}
    copies: dict[tuple[int, bool], Tensor] = {}
    host: bool | None = None
    start = n_inputs = 0
    for i, node in enumerate(nodes):
        if node.op in VIEW_OPS:
            continue
        if host is None or node.host != host or (n_inputs and not node.host and any(s.copy_bytes for s in node.src)):
            host, start, n_inputs = node.host, i, 0
        src = list(node.src)
        for j, s in enumerate(src):
            if not (bool(s.copy_bytes) and not node.host if s.external else _on_host(s) != node.host):
                continue
            key = (id(s), node.host)
            if key not in copies:
                copy = Tensor((s.copy_bytes,), 1) if s.external else Tensor(s.ne, s.es, nb=s.nb)
                copy.host = node.host
                copies[key] = copy
                n_inputs += 1
                out.setdefault(start, []).append((s, copy))
            src[j] = copies[key]
        node.src = tuple(src)
    return out


def mark_outputs(tensors: Iterable[Tensor]) -> None:
    """``llm_graph_result::set_outputs``: logits and embeddings are never freed nor overwritten."""
    for t in tensors:
        t.is_output = True
