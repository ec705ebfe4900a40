/* Search core of memplan.alloc.dsa: MiniMalloc's depth-first search, written in C for speed.
 *
 * The algorithm is the one of dsa._Search (the pure-Python fallback, which gives the same offsets):
 * Moffitt, "MiniMalloc: A Lightweight Memory Allocator for Hardware-Accelerated Machine Learning",
 * ASPLOS 2023. Buffers are placed in non-decreasing offset order, each at its minimum offset (the
 * highest top of the placed buffers it overlaps in time), with canonical, dominance, section-
 * inference and "hatless" pruning, dynamic temporal decomposition, and a round robin over static
 * preorderings under a doubling node limit.
 *
 * search(starts, ends, sizes, capacity, time_limit, heuristics) -> (status, offsets | None, nodes)
 * status: "ok", "infeasible" (the search proved no placement fits), "timeout". Sizes must be
 * positive (dsa.solve leaves zero-size buffers out) and every start below its end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int64_t i64;

enum { ST_OK, ST_NOTFOUND, ST_ABORTED, ST_TIMEOUT, ST_NOMEM };

#define CLOCK_EVERY 256

typedef struct {
    i64 *data;
    size_t len, cap;
} Stack; /* pairs (index, old value) pushed as two entries */

typedef struct {
    int n, n_sec;
    const i64 *size, *width;
    const int *lo, *hi;        /* section range [lo, hi) of each buffer */
    const int *sec_ptr;        /* members of each section (CSR): the unplaced ones first */
    int *sec_buf, *n_free;     /* ... and how many of them are unplaced */
    const int *span_ptr;       /* where[span_ptr[i] + s - lo[i]]: position of i in section s */
    int *where;
    const int *ov_ptr, *ov_buf;   /* buffers overlapping each buffer in time (CSR) */
    i64 capacity;
    i64 *off, *min_off, *floor, *total, *solution;
    int *cuts;                 /* unplaced buffers spanning the boundary between section s and s + 1 */
    i64 *mark, stamp;          /* de-duplicates affected sections */
    int *affected;
    Stack min_changes, floor_changes;
    i64 nodes_left, nodes;
    double deadline;
    int interrupted;
    const char *key;
} Ctx;

typedef struct {
    i64 off;
    int rank, buf;
} Cand;

typedef struct {
    i64 k[3];
    int buf;
} Pre;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int push2(Stack *st, i64 a, i64 b) {
    if (st->len + 2 > st->cap) {
        size_t cap = st->cap ? 2 * st->cap : 1024;
        i64 *data = realloc(st->data, cap * sizeof(i64));
        if (!data) return -1;
        st->data = data;
        st->cap = cap;
    }
    st->data[st->len++] = a;
    st->data[st->len++] = b;
    return 0;
}

static int cmp_cand(const void *pa, const void *pb) {
    const Cand *a = pa, *b = pb;
    if (a->off != b->off) return a->off < b->off ? -1 : 1;
    return a->rank - b->rank;
}

static int cmp_pre(const void *pa, const void *pb) {
    const Pre *a = pa, *b = pb;
    for (int t = 0; t < 3; t++)
        if (a->k[t] != b->k[t]) return a->k[t] > b->k[t] ? -1 : 1; /* larger first */
    return a->buf - b->buf;
}

/* Static preorder of the buffers in `bufs` (in place) by the heuristic letters of ctx->key:
 * T the largest unplaced total of a section it spans, W its lifetime, A size x lifetime. */
static int preorder(Ctx *c, int *bufs, int m) {
    Pre *pre = malloc((size_t)(m ? m : 1) * sizeof(Pre));
    if (!pre) return -1;
    for (int r = 0; r < m; r++) {
        int i = bufs[r];
        i64 t = 0;
        for (int s = c->lo[i]; s < c->hi[i]; s++)
            if (c->total[s] > t) t = c->total[s];
        pre[r].buf = i;
        for (int k = 0; k < 3; k++) {
            char ch = c->key[k];
            pre[r].k[k] = ch == 'T' ? t : ch == 'W' ? c->width[i] : ch == 'A' ? c->size[i] * c->width[i] : 0;
        }
    }
    qsort(pre, (size_t)m, sizeof(Pre), cmp_pre);
    for (int r = 0; r < m; r++) bufs[r] = pre[r].buf;
    free(pre);
    return 0;
}

static int search(Ctx *c, const int *order, int m, int plo, int phi, i64 min_offset, int min_rank);

/* Section inference: in every section of the partition, max(floor, o) + unplaced bytes <= capacity. */
static int feasible(const Ctx *c, int plo, int phi, i64 o) {
    for (int s = plo; s < phi; s++) {
        i64 f = c->floor[s] > o ? c->floor[s] : o;
        if (f + c->total[s] > c->capacity) return 0;
    }
    return 1;
}

/* Places buffer i at o, recording what changed for unplace(). Returns 1 when the partial placement
 * passes section inference on sections [plo, phi), 0 when not, -1 out of memory; *hatless is set
 * when no unplaced buffer overlaps i in time. */
static int place(Ctx *c, int i, i64 o, int plo, int phi, int *hatless) {
    i64 top = o + c->size[i];
    int n_aff = 0;
    c->off[i] = o;
    c->stamp++;
    for (int s = c->lo[i]; s < c->hi[i]; s++) {
        if (push2(&c->floor_changes, s, c->floor[s])) return -1;
        c->floor[s] = top;
        c->total[s] -= c->size[i];
        int pos = c->where[c->span_ptr[i] + s - c->lo[i]], last = c->sec_ptr[s] + --c->n_free[s];
        int b = c->sec_buf[last]; /* swap i behind the unplaced members */
        c->sec_buf[pos] = b;
        c->where[c->span_ptr[b] + s - c->lo[b]] = pos;
        c->sec_buf[last] = i;
        c->where[c->span_ptr[i] + s - c->lo[i]] = last;
    }
    *hatless = 1;
    if (!feasible(c, plo, phi, o)) { /* raising floors below can only make it worse */
        for (int p = c->ov_ptr[i]; p < c->ov_ptr[i + 1] && *hatless; p++)
            if (c->off[c->ov_buf[p]] < 0) *hatless = 0;
        return 0;
    }
    for (int p = c->ov_ptr[i]; p < c->ov_ptr[i + 1]; p++) {
        int j = c->ov_buf[p];
        if (c->off[j] >= 0) continue;
        *hatless = 0;
        if (c->min_off[j] >= top) continue;
        if (push2(&c->min_changes, j, c->min_off[j])) return -1;
        c->min_off[j] = top;
        for (int s = c->lo[j]; s < c->hi[j]; s++)
            if (c->mark[s] != c->stamp) {
                c->mark[s] = c->stamp;
                c->affected[n_aff++] = s;
            }
    }
    /* a section's floor is at least the lowest minimum offset of its unplaced buffers */
    for (int a = 0; a < n_aff; a++) {
        int s = c->affected[a];
        i64 lowest = INT64_MAX, floor = c->floor[s];
        if (floor >= top) continue; /* a changed buffer here now has min offset top: no raise */
        for (int p = c->sec_ptr[s], q = p + c->n_free[s]; p < q && lowest > floor; p++) {
            i64 m = c->min_off[c->sec_buf[p]];
            if (m < lowest) lowest = m;
        }
        if (lowest != INT64_MAX && floor < lowest) {
            if (push2(&c->floor_changes, s, floor)) return -1;
            c->floor[s] = lowest;
            if (s >= plo && s < phi && (lowest > o ? lowest : o) + c->total[s] > c->capacity) return 0;
        }
    }
    return 1;
}

static void unplace(Ctx *c, int i, size_t min_mark, size_t floor_mark) {
    while (c->floor_changes.len > floor_mark) {
        c->floor_changes.len -= 2;
        const i64 *change = c->floor_changes.data + c->floor_changes.len;
        c->floor[change[0]] = change[1];
    }
    for (int s = c->lo[i]; s < c->hi[i]; s++) {
        c->total[s] += c->size[i];
        c->n_free[s]++; /* placements are undone last-in first-out: i is right behind them */
    }
    while (c->min_changes.len > min_mark) {
        c->min_changes.len -= 2;
        c->min_off[c->min_changes.data[c->min_changes.len]] = c->min_changes.data[c->min_changes.len + 1];
    }
    c->off[i] = -1;
}

/* Solves a partition (its unplaced buffers, preordered) from scratch: a fresh canonical order. */
static int sub_solve(Ctx *c, int *bufs, int m, int plo, int phi) {
    if (preorder(c, bufs, m)) return ST_NOMEM;
    return search(c, bufs, m, plo, phi, 0, 0);
}

/* Solves the unplaced buffers of `order` as independent partitions, split at the section boundaries
 * cutpoints[0] < ... < cutpoints[n_cut - 1] (no unplaced buffer crosses one). */
static int solve_parts(Ctx *c, const int *order, int m, const int *cutpoints, int n_cut) {
    int status = ST_OK;
    int *sub = malloc((size_t)(m ? m : 1) * sizeof(int));
    if (!sub) return ST_NOMEM;
    for (int k = 1; k < n_cut && status == ST_OK; k++) {
        int a = cutpoints[k - 1], b = cutpoints[k], count = 0;
        for (int r = 0; r < m; r++) {
            int j = order[r];
            if (c->off[j] < 0 && c->lo[j] < b && a < c->hi[j]) sub[count++] = j;
        }
        if (count) status = sub_solve(c, sub, count, a, b);
    }
    free(sub);
    return status;
}

/* After placing i: once no unplaced buffer spans a section boundary, the two sides are independent. */
static int decompose(Ctx *c, const int *order, int m, int plo, int phi, i64 o, int rank, int i) {
    int status, n_cut = 1;
    int *cutpoints = malloc((size_t)(c->hi[i] - c->lo[i] + 2) * sizeof(int));
    if (!cutpoints) return ST_NOMEM;
    c->solution[i] = o;
    cutpoints[0] = plo;
    for (int s = c->lo[i]; s + 1 < c->hi[i]; s++)
        if (--c->cuts[s] == 0) cutpoints[n_cut++] = s + 1;
    if (n_cut == 1) {
        status = search(c, order, m, plo, phi, o, rank);
    } else {
        cutpoints[n_cut++] = phi;
        status = solve_parts(c, order, m, cutpoints, n_cut);
    }
    for (int s = c->lo[i]; s + 1 < c->hi[i]; s++) c->cuts[s]++;
    free(cutpoints);
    return status;
}

static int search(Ctx *c, const int *order, int m, int plo, int phi, i64 min_offset, int min_rank) {
    if (c->nodes_left <= 0) return ST_ABORTED;
    c->nodes_left--;
    if ((++c->nodes % CLOCK_EVERY) == 0) {
        if (PyErr_CheckSignals() < 0) c->interrupted = 1; /* Ctrl-C: stop, raise KeyboardInterrupt */
        if (c->interrupted || now_s() > c->deadline) return ST_TIMEOUT;
    }
    Cand *cand = malloc((size_t)(m ? m : 1) * sizeof(Cand));
    if (!cand) return ST_NOMEM;
    int k = 0;
    for (int r = 0; r < m; r++) {
        int i = order[r];
        if (c->off[i] < 0) {
            cand[k].off = c->min_off[i];
            cand[k].rank = r;
            cand[k].buf = i;
            k++;
        }
    }
    if (k == 0) { /* a leaf: every buffer of this partition is placed */
        for (int r = 0; r < m; r++) c->solution[order[r]] = c->off[order[r]];
        free(cand);
        return ST_OK;
    }
    qsort(cand, (size_t)k, sizeof(Cand), cmp_cand);
    i64 min_height = INT64_MAX;
    for (int q = 0; q < k; q++)
        if (cand[q].off + c->size[cand[q].buf] < min_height) min_height = cand[q].off + c->size[cand[q].buf];
    int status = ST_NOTFOUND;
    for (int q = 0; q < k; q++) {
        i64 o = cand[q].off;
        int r = cand[q].rank, i = cand[q].buf, hatless;
        if (o < min_offset || (o == min_offset && r < min_rank)) continue; /* canonical order */
        if (o >= min_height) break; /* dominance: a gap an unplaced buffer could fill */
        size_t min_mark = c->min_changes.len, floor_mark = c->floor_changes.len;
        int placed = place(c, i, o, plo, phi, &hatless);
        if (placed < 0) status = ST_NOMEM;
        else if (placed) status = decompose(c, order, m, plo, phi, o, r, i);
        unplace(c, i, min_mark, floor_mark);
        if (status != ST_NOTFOUND) break;
        if (hatless) break; /* nothing above it: any other choice here is no better */
    }
    free(cand);
    return status;
}

static int cmp_i64v(const void *pa, const void *pb) {
    i64 a = *(const i64 *)pa, b = *(const i64 *)pb;
    return a < b ? -1 : a > b;
}

static int lookup(const i64 *points, int np, i64 t) {
    int lo = 0, hi = np - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (points[mid] < t) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int read_i64s(PyObject *seq, Py_ssize_t n, i64 *out, const char *name) {
    PyObject *fast = PySequence_Fast(seq, name);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s must have %zd items", name, n);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < n; k++) {
        out[k] = PyLong_AsLongLong(items[k]);
        if (out[k] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static void reset(Ctx *c, const i64 *total0, const int *cuts0) {
    for (int i = 0; i < c->n; i++) {
        c->off[i] = -1;
        c->min_off[i] = 0;
        c->solution[i] = -1;
    }
    for (int s = 0; s < c->n_sec; s++) {
        c->floor[s] = 0;
        c->total[s] = total0[s];
        c->cuts[s] = cuts0[s];
        c->n_free[s] = c->sec_ptr[s + 1] - c->sec_ptr[s];
    }
    c->min_changes.len = c->floor_changes.len = 0;
}

static int round_robin(Ctx *c, const char **keys, int n_keys, const i64 *total0, const int *cuts0, int *order,
                       int *cutpoints) {
    i64 limit = c->n > 0 ? c->n : 1;
    for (;;) {
        limit *= 2;
        for (int h = 0; h < n_keys; h++) {
            c->key = keys[h];
            reset(c, total0, cuts0);
            c->nodes_left = limit;
            int n_cut = 0;
            for (int i = 0; i < c->n; i++) order[i] = i;
            cutpoints[n_cut++] = 0; /* independent partitions from the start: boundaries nothing crosses */
            for (int s = 0; s + 1 < c->n_sec; s++)
                if (cuts0[s] == 0) cutpoints[n_cut++] = s + 1;
            cutpoints[n_cut++] = c->n_sec;
            int status = solve_parts(c, order, c->n, cutpoints, n_cut);
            if (status != ST_ABORTED) return status;
            if (c->interrupted || now_s() > c->deadline) return ST_TIMEOUT;
        }
    }
}

static PyObject *py_search(PyObject *self, PyObject *args) {
    PyObject *py_starts, *py_ends, *py_sizes, *py_keys;
    long long capacity;
    double time_limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOLdO", &py_starts, &py_ends, &py_sizes, &capacity, &time_limit, &py_keys))
        return NULL;
    Py_ssize_t n = PySequence_Length(py_sizes);
    if (n < 0) return NULL;
    if (n > INT32_MAX / 4) return PyErr_Format(PyExc_ValueError, "too many buffers: %zd", n);
    PyObject *keys_fast = PySequence_Fast(py_keys, "heuristics must be a sequence of strings");
    if (!keys_fast) return NULL;
    int n_keys = (int)PySequence_Fast_GET_SIZE(keys_fast);
    const char *keys[16];
    if (n_keys < 1 || n_keys > 16) {
        Py_DECREF(keys_fast);
        return PyErr_Format(PyExc_ValueError, "between 1 and 16 heuristics are needed");
    }
    for (int h = 0; h < n_keys; h++) {
        keys[h] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(keys_fast, h));
        if (!keys[h]) {
            Py_DECREF(keys_fast);
            return NULL;
        }
        if (strlen(keys[h]) != 3) {
            Py_DECREF(keys_fast);
            return PyErr_Format(PyExc_ValueError, "a heuristic is three letters of T, W, A: %s", keys[h]);
        }
    }
    size_t nn = (size_t)(n ? n : 1), n2 = 2 * nn;
    i64 *start = calloc(nn, sizeof(i64)), *end = calloc(nn, sizeof(i64)), *size = calloc(nn, sizeof(i64));
    i64 *width = calloc(nn, sizeof(i64)), *points = calloc(n2, sizeof(i64));
    int *lo = calloc(nn, sizeof(int)), *hi = calloc(nn, sizeof(int)), *order = calloc(nn, sizeof(int));
    i64 *off = calloc(nn, sizeof(i64)), *min_off = calloc(nn, sizeof(i64));
    i64 *solution = calloc(nn, sizeof(i64)), *floor_ = calloc(n2, sizeof(i64));
    i64 *total = calloc(n2, sizeof(i64)), *total0 = calloc(n2, sizeof(i64));
    i64 *mark = calloc(n2, sizeof(i64));
    int *cuts = calloc(n2, sizeof(int)), *cuts0 = calloc(n2, sizeof(int));
    int *affected = calloc(n2, sizeof(int));
    int *sec_ptr = calloc(n2 + 1, sizeof(int)), *ov_ptr = calloc(nn + 1, sizeof(int));
    int *sec_buf = NULL, *ov_buf = NULL, *where = NULL, *n_free = calloc(n2, sizeof(int));
    int *span_ptr = calloc(nn + 1, sizeof(int)), *parts = calloc(n2 + 1, sizeof(int));
    PyObject *result = NULL;
    Ctx c;
    memset(&c, 0, sizeof c);
    if (!start || !end || !size || !width || !points || !lo || !hi || !order || !off || !min_off ||
        !solution || !floor_ || !total || !total0 || !mark || !cuts || !cuts0 || !affected || !sec_ptr ||
        !ov_ptr || !n_free || !span_ptr || !parts) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_i64s(py_starts, n, start, "starts") || read_i64s(py_ends, n, end, "ends") ||
        read_i64s(py_sizes, n, size, "sizes"))
        goto done;
    int np = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (end[i] <= start[i] || size[i] <= 0) { /* a zero size would defeat the dominance rule */
            PyErr_Format(PyExc_ValueError, "buffer %zd needs start < end and size > 0", i);
            goto done;
        }
        width[i] = end[i] - start[i];
        points[np++] = start[i];
        points[np++] = end[i];
    }
    qsort(points, (size_t)np, sizeof(i64), cmp_i64v);
    int u = 0;
    for (int k = 0; k < np; k++)
        if (u == 0 || points[k] != points[u - 1]) points[u++] = points[k];
    int n_sec = u > 1 ? u - 1 : 1;
    size_t members = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        lo[i] = lookup(points, u, start[i]);
        hi[i] = lookup(points, u, end[i]);
        members += (size_t)(hi[i] - lo[i]);
        for (int s = lo[i]; s < hi[i]; s++) {
            sec_ptr[s + 1]++;
            total0[s] += size[i];
            if (s + 1 < hi[i]) cuts0[s]++;
        }
    }
    for (int s = 0; s < n_sec; s++) sec_ptr[s + 1] += sec_ptr[s];
    sec_buf = malloc((members ? members : 1) * sizeof(int));
    where = malloc((members ? members : 1) * sizeof(int));
    size_t n_ov = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t j = 0; j < n; j++)
            if (i != j && start[j] < end[i] && start[i] < end[j]) n_ov++;
    ov_buf = malloc((n_ov ? n_ov : 1) * sizeof(int));
    if (!sec_buf || !ov_buf || !where) {
        PyErr_NoMemory();
        goto done;
    }
    int *fill = cuts; /* scratch: next free slot of each section */
    for (int s = 0; s < n_sec; s++) fill[s] = sec_ptr[s];
    for (Py_ssize_t i = 0; i < n; i++) {
        span_ptr[i + 1] = span_ptr[i] + hi[i] - lo[i];
        for (int s = lo[i]; s < hi[i]; s++) {
            where[span_ptr[i] + s - lo[i]] = fill[s];
            sec_buf[fill[s]++] = (int)i;
        }
    }
    n_ov = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t j = 0; j < n; j++)
            if (i != j && start[j] < end[i] && start[i] < end[j]) ov_buf[n_ov++] = (int)j;
        ov_ptr[i + 1] = (int)n_ov;
    }
    c.n = (int)n;
    c.n_sec = n_sec;
    c.size = size;
    c.width = width;
    c.lo = lo;
    c.hi = hi;
    c.sec_ptr = sec_ptr;
    c.sec_buf = sec_buf;
    c.n_free = n_free;
    c.span_ptr = span_ptr;
    c.where = where;
    c.ov_ptr = ov_ptr;
    c.ov_buf = ov_buf;
    c.capacity = capacity;
    c.off = off;
    c.min_off = min_off;
    c.floor = floor_;
    c.total = total;
    c.solution = solution;
    c.cuts = cuts;
    c.mark = mark;
    c.affected = affected;
    c.deadline = now_s() + time_limit;
    int status = round_robin(&c, keys, n_keys, total0, cuts0, order, parts);
    if (status == ST_NOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    if (c.interrupted) goto done; /* the signal handler's exception is set */
    PyObject *offsets = Py_None;
    Py_INCREF(Py_None);
    if (status == ST_OK) {
        Py_DECREF(Py_None);
        offsets = PyList_New(n);
        if (!offsets) goto done;
        for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(offsets, i, PyLong_FromLongLong(solution[i]));
    }
    const char *name = status == ST_OK ? "ok" : status == ST_NOTFOUND ? "infeasible" : "timeout";
    result = Py_BuildValue("sNL", name, offsets, (long long)c.nodes);
done:
    Py_DECREF(keys_fast);
    free(start); free(end); free(size); free(width); free(points); free(lo); free(hi); free(order);
    free(off); free(min_off); free(solution); free(floor_); free(total); free(total0); free(mark);
    free(cuts); free(cuts0); free(affected); free(sec_ptr); free(ov_ptr); free(sec_buf); free(ov_buf);
    free(where); free(n_free); free(span_ptr); free(parts);
    free(c.min_changes.data); free(c.floor_changes.data);
    return result;
}

static PyMethodDef methods[] = {
    {"search", py_search, METH_VARARGS,
     "search(starts, ends, sizes, capacity, time_limit, heuristics) -> (status, offsets | None, nodes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dsa_search", "MiniMalloc search core (C).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dsa_search(void) { return PyModule_Create(&module); }
