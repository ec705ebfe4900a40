/* memplan runtime core: a planned arena, a matcher, a fallback caching pool, stream-safe frees.
 *
 * Plain C99 + POSIX (pthreads, dlopen); no Python, no PyTorch. Built by setup.py as an optional
 * extension (memplan/alloc/runtime/_core*.so) and loaded with ctypes: the CUDA pluggable
 * allocator needs plain C symbols in a shared library (mpr_cuda_malloc / mpr_cuda_free), and the
 * CPU allocator (a small C++ file) calls mpr_malloc / mpr_free_block through function pointers,
 * so a CPython module would add nothing. See docs/runtime.md.
 *
 * One arena (struct mpr_arena) serves requests in steps (iterations) marked by the caller:
 *   mpr_begin_step(a, plan)   plan < 0: record the step (everything served by the fallback pool and
 *                             logged); plan >= 0: replay that plan.
 *   mpr_end_step(a)           closes the step; the log of the step *before* it is then final
 *                             (its blocks freed during this step are "wrap", still live "persistent").
 * Replay (the matcher): the k-th request of a step is matched to slot k of the plan when its stream
 * is the slot's and slot k recorded its size; otherwise to the next of the WINDOW slots that did
 * (resynchronisation: slots in between are skipped); otherwise to slot k when the size fits its
 * window (slots are sized to the largest size recorded there). No match, a slot marked fallback (persistent in the recording), a slot
 * that does not fit the region, or a slot overlapping a live or not-yet-safe block: the fallback
 * pool serves the request, counted. So no two live blocks overlap, whatever the plan says.
 * Fallback pool: 512-byte rounding, a small pool (<= 1 MiB, 2 MiB segments) and a large pool
 * (segments rounded to 2 MiB), best fit by (stream, size, address), splitting, merging on free, fully
 * free segments released above a bound. Blocks are reused only by their own stream.
 * Streams: mpr_record_stream(ptr, s) marks a use on another stream; freeing such a block records a
 * marker on each of those streams (mpr_stream_marker) and the block stays reserved (pending) until
 * mpr_stream_complete(s, marker) reports every marker reached (PyTorch's record_stream rule).
 */
#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE /* madvise(MADV_HUGEPAGE) beside -std=c99 -D_POSIX_C_SOURCE */
#endif
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef uint64_t u64;
typedef int64_t i64;

#define BACKEND_VIRTUAL 0
#define BACKEND_HOST 1
#define BACKEND_CUDA 2

#define MAX_STREAMS 64
#define MAX_WAITS 8
#define MIN_BLOCK 512ULL
#define SMALL_SIZE (1ULL << 20)
#define SMALL_SEGMENT (2ULL << 20)
#define SEGMENT_ROUND (2ULL << 20)
#define LARGE_SPLIT_MIN (1ULL << 20)
#define HOST_ALIGN 64
#define HUGE_PAGE (2ULL << 20)
#define WINDOW 1024
#define SWAP_WINDOW 64
#define NO_SLOT UINT64_MAX
#define END_WRAP (-2)
#define END_LIVE (-1)
#define VIRTUAL_BASE (1ULL << 40)

enum { ST_FREE = 0, ST_LIVE = 1, ST_PENDING = 2 };

/* counters, in the order mpr_stats writes them (memplan/alloc/runtime/_native.py: STAT_NAMES) */
enum {
    C_PLANNED, C_ARENA, C_FB_ALLOCS, C_FB_BYTES, C_FB_RESERVED, C_FB_PEAK, C_REPLAYED, C_REPLAYED_BYTES,
    C_RECORDED, C_ALLOCS, C_BYTES, C_LIVE, C_PEAK_LIVE, C_MISMATCH, C_OVERLAP, C_PENDING, C_ARENA_PEAK_LIVE,
    C_SMALL, C_RAW_ALLOCS, C_RAW_FREES, C_SKIPPED, C_STEPS, C_OVERSIZE, C_RESERVED, C_PEAK_RESERVED,
    C_PLANNED_FB, C_ARENA_LIVE, C_ARENA_FAILED, C_STREAM_WAIT, C_SWAPPED, C_RECORDED_IN_ARENA, N_COUNTERS
};

struct Segment;
struct Region;

typedef struct Block {
    u64 addr, size, requested;
    int stream, nwait;
    unsigned char arena, state, small;
    struct Segment *seg;
    struct Block *prev, *next;  /* address neighbours in a fallback segment */
    struct Region *region;
    struct Block *hnext, *pnext; /* hash chain; pending list or spare list */
    u64 uses;                   /* streams (bit per id) the block was used on besides its own */
    int wait_stream[MAX_WAITS];
    u64 wait_marker[MAX_WAITS];
    i64 rec_gen, rec_idx, trace_id;
    struct mpr_arena *owner;
} Block;

typedef struct Segment { u64 addr, size; int small, stream; struct Segment *prev, *next; } Segment;

typedef struct { u64 off, end; } Span;

typedef struct { u64 off, end; int stream; } Dirty;

#define DIRTY_LIMIT 65536

typedef struct Region {
    u64 addr, size, live;
    Span *spans;
    size_t n, cap;
    Dirty *dirty;     /* ranges freed by a stream since the last mpr_synchronize, kept with one stream too:
                       * a stream first seen later must not get a range the first one freed unsynchronised */
    size_t nd, capd;
    u64 dirty_all;    /* streams (bit per id) whose frees overflowed the list: the whole region is theirs */
    struct Region *next;
} Region;

typedef struct { Block **items; size_t n, cap; } FreeList;

typedef struct { u64 n, pool; u64 *size, *req, *offset; int *stream; } Plan;

typedef struct { i64 n, cap, gen, pos; u64 *req; int *stream; i64 *start, *end; } Log;

/* Every request and free, when asked (mpr_trace_enable): a memplan trace of the run. */
typedef struct { i64 n, cap, next_id; i64 *id, *size, *stream, *step; unsigned char *kind; } TraceBuf;

typedef struct mpr_arena {
    pthread_mutex_t lock;
    int backend, closed, passthrough, hugepages;
    u64 alignment, fallback_limit, arena_limit, next_virtual;
    void *(*raw_alloc)(struct mpr_arena *, u64);
    void (*raw_free)(struct mpr_arena *, void *, u64);
    int (*cuda_malloc)(void **, size_t);
    int (*cuda_free)(void *);
    void *lib;
    i64 stream_handle[MAX_STREAMS];
    u64 issued[MAX_STREAMS], completed[MAX_STREAMS];
    int n_streams;
    Block **buckets;
    u64 n_buckets, n_blocks;
    Block *spare, *pending;
    FreeList free_small, free_large;
    Segment *segments;
    Region *region, *retired;
    Plan *plans;
    int n_plans, cap_plans, active;
    u64 cursor;
    Log cur, prev, ready;
    TraceBuf trace;
    i64 gen;
    u64 c[N_COUNTERS];
    struct mpr_arena *next_global;
} mpr_arena;

static mpr_arena *g_current = NULL, *g_all = NULL;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static u64 align_up(u64 v, u64 a) { return (v + a - 1) / a * a; }

/* ---------- backends ---------- */

static void *virtual_alloc(mpr_arena *a, u64 size) {
    u64 addr = a->next_virtual;
    a->next_virtual += align_up(size ? size : 1, SEGMENT_ROUND);
    return (void *)(uintptr_t)addr;
}
static void virtual_free(mpr_arena *a, void *p, u64 size) { (void)a; (void)p; (void)size; }
static void *host_alloc(mpr_arena *a, u64 size) {
    void *p = NULL;
    (void)a;
    return posix_memalign(&p, HOST_ALIGN, size ? size : HOST_ALIGN) == 0 ? p : NULL;
}
static void host_free(mpr_arena *a, void *p, u64 size) { (void)a; (void)size; free(p); }
/* The planned region on the host: 2 MiB aligned and advised to the kernel for transparent huge pages
 * (one TLB entry per 2 MiB of a region every step walks; the kernel's "madvise" mode needs the advice). */
static void *host_region_alloc(mpr_arena *a, u64 size) {
    void *p = NULL;
    if (!a->hugepages) return host_alloc(a, size);
    if (posix_memalign(&p, HUGE_PAGE, align_up(size ? size : 1, HUGE_PAGE)) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, align_up(size ? size : 1, HUGE_PAGE), MADV_HUGEPAGE);
#endif
    return p;
}
static void *cuda_alloc(mpr_arena *a, u64 size) {
    void *p = NULL;
    return a->cuda_malloc(&p, (size_t)size) == 0 ? p : NULL;
}
static void cuda_free_raw(mpr_arena *a, void *p, u64 size) { (void)size; a->cuda_free(p); }

static void *raw_alloc(mpr_arena *a, u64 size) {
    void *p = a->raw_alloc(a, size);
    if (p) a->c[C_RAW_ALLOCS]++;
    return p;
}
static void raw_free(mpr_arena *a, void *p, u64 size) { a->raw_free(a, p, size); a->c[C_RAW_FREES]++; }

static void note_reserved(mpr_arena *a) {
    a->c[C_RESERVED] = a->c[C_ARENA] + a->c[C_FB_RESERVED];
    if (a->c[C_RESERVED] > a->c[C_PEAK_RESERVED]) a->c[C_PEAK_RESERVED] = a->c[C_RESERVED];
    if (a->c[C_FB_RESERVED] > a->c[C_FB_PEAK]) a->c[C_FB_PEAK] = a->c[C_FB_RESERVED];
}

/* ---------- streams ---------- */

static int stream_id(mpr_arena *a, i64 handle) {
    for (int i = 0; i < a->n_streams; i++) if (a->stream_handle[i] == handle) return i;
    if (a->n_streams == MAX_STREAMS) return -1;
    a->stream_handle[a->n_streams] = handle;
    return a->n_streams++;
}

/* ---------- blocks and the address hash ---------- */

static Block *new_block(mpr_arena *a) {
    Block *b = a->spare;
    if (b) a->spare = b->pnext; else b = (Block *)malloc(sizeof(Block));
    if (!b) return NULL;
    memset(b, 0, sizeof(Block));
    b->rec_gen = -1;
    b->owner = a;
    return b;
}
static void drop_block(mpr_arena *a, Block *b) { b->pnext = a->spare; a->spare = b; }

static u64 hash_of(mpr_arena *a, u64 addr) { return ((addr >> 6) * 0x9E3779B97F4A7C15ULL) & (a->n_buckets - 1); }

static int hash_grow(mpr_arena *a) {
    u64 n = a->n_buckets ? a->n_buckets * 2 : 1024;
    Block **nb = (Block **)calloc(n, sizeof(Block *));
    if (!nb) return -1;
    Block **old = a->buckets;
    u64 old_n = a->n_buckets;
    a->buckets = nb;
    a->n_buckets = n;
    for (u64 i = 0; i < old_n; i++) {
        for (Block *b = old[i], *nx; b; b = nx) {
            nx = b->hnext;
            u64 h = hash_of(a, b->addr);
            b->hnext = nb[h];
            nb[h] = b;
        }
    }
    free(old);
    return 0;
}
static int hash_put(mpr_arena *a, Block *b) {
    if (a->n_blocks + 1 > a->n_buckets && hash_grow(a) != 0) return -1;
    u64 h = hash_of(a, b->addr);
    b->hnext = a->buckets[h];
    a->buckets[h] = b;
    a->n_blocks++;
    return 0;
}
static Block *hash_find(mpr_arena *a, u64 addr) {
    if (!a->n_buckets) return NULL;
    for (Block *b = a->buckets[hash_of(a, addr)]; b; b = b->hnext) if (b->addr == addr) return b;
    return NULL;
}
static void hash_del(mpr_arena *a, Block *b) {
    Block **pp = &a->buckets[hash_of(a, b->addr)];
    while (*pp && *pp != b) pp = &(*pp)->hnext;
    if (*pp) { *pp = b->hnext; a->n_blocks--; }
}

/* ---------- fallback pool ---------- */

static int key_less(const Block *x, int stream, u64 size, u64 addr) {
    if (x->stream != stream) return x->stream < stream;
    if (x->size != size) return x->size < size;
    return x->addr < addr;
}
static size_t fl_lower(FreeList *f, int stream, u64 size, u64 addr) {
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (key_less(f->items[mid], stream, size, addr)) lo = mid + 1; else hi = mid;
    }
    return lo;
}
static int fl_insert(FreeList *f, Block *b) {
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 256;
        Block **items = (Block **)realloc(f->items, cap * sizeof(Block *));
        if (!items) return -1;
        f->items = items;
        f->cap = cap;
    }
    size_t i = fl_lower(f, b->stream, b->size, b->addr);
    memmove(f->items + i + 1, f->items + i, (f->n - i) * sizeof(Block *));
    f->items[i] = b;
    f->n++;
    return 0;
}
static void fl_remove(FreeList *f, Block *b) {
    size_t i = fl_lower(f, b->stream, b->size, b->addr);
    if (i < f->n && f->items[i] == b) {
        memmove(f->items + i, f->items + i + 1, (f->n - i - 1) * sizeof(Block *));
        f->n--;
    }
}

static void release_segment(mpr_arena *a, Segment *s, Block *only) {
    if (s->prev) s->prev->next = s->next; else a->segments = s->next;
    if (s->next) s->next->prev = s->prev;
    fl_remove(s->small ? &a->free_small : &a->free_large, only);
    drop_block(a, only);
    raw_free(a, (void *)(uintptr_t)s->addr, s->size);
    a->c[C_FB_RESERVED] -= s->size;
    free(s);
    note_reserved(a);
}

/* Release fully free segments, largest first, while the pool reserves more than `keep`. */
static void release_free_segments(mpr_arena *a, u64 keep) {
    for (Segment *s = a->segments, *nx; s && a->c[C_FB_RESERVED] > keep; s = nx) {
        nx = s->next;
        /* a segment is free when its first block is free and spans the whole segment */
        FreeList *f = s->small ? &a->free_small : &a->free_large;
        for (size_t i = 0; i < f->n; i++) {
            Block *x = f->items[i];
            if (x->seg == s && x->size == s->size) { release_segment(a, s, x); break; }
        }
    }
}

static Block *new_segment(mpr_arena *a, u64 rsize, int stream, int small) {
    u64 size = small ? SMALL_SEGMENT : align_up(rsize, SEGMENT_ROUND);
    void *p = raw_alloc(a, size);
    if (!p) {
        release_free_segments(a, 0);
        p = raw_alloc(a, size);
        if (!p) return NULL;
    }
    Segment *s = (Segment *)calloc(1, sizeof(Segment));
    Block *b = new_block(a);
    if (!s || !b) { raw_free(a, p, size); free(s); return NULL; }
    s->addr = (u64)(uintptr_t)p;
    s->size = size;
    s->small = small;
    s->stream = stream;
    s->next = a->segments;
    if (a->segments) a->segments->prev = s;
    a->segments = s;
    b->addr = s->addr;
    b->size = size;
    b->seg = s;
    b->stream = stream;
    b->small = (unsigned char)small;
    a->c[C_FB_RESERVED] += size;
    note_reserved(a);
    return b;
}

static Block *fallback_alloc(mpr_arena *a, u64 size, int stream) {
    u64 rsize = size < MIN_BLOCK ? MIN_BLOCK : align_up(size, MIN_BLOCK);
    int small = rsize <= SMALL_SIZE;
    FreeList *f = small ? &a->free_small : &a->free_large;
    size_t i = fl_lower(f, stream, rsize, 0);
    Block *b;
    if (i < f->n && f->items[i]->stream == stream) {
        b = f->items[i];
        memmove(f->items + i, f->items + i + 1, (f->n - i - 1) * sizeof(Block *));
        f->n--;
    } else {
        b = new_segment(a, rsize, stream, small);
        if (!b) return NULL;
    }
    u64 rest = b->size - rsize;
    if (small ? rest >= MIN_BLOCK : rest > LARGE_SPLIT_MIN) {
        Block *r = new_block(a);
        if (r) {
            r->addr = b->addr + rsize;
            r->size = rest;
            r->seg = b->seg;
            r->stream = stream;
            r->small = b->small;
            r->prev = b;
            r->next = b->next;
            if (b->next) b->next->prev = r;
            b->next = r;
            b->size = rsize;
            fl_insert(f, r);
        }
    }
    b->state = ST_LIVE;
    b->arena = 0;
    if (small) a->c[C_SMALL]++;
    return b;
}

static void fallback_release(mpr_arena *a, Block *b) {
    FreeList *f = b->small ? &a->free_small : &a->free_large;
    b->state = ST_FREE;
    b->uses = 0;
    b->nwait = 0;
    Block *p = b->prev, *n = b->next;
    if (p && p->state == ST_FREE) {
        fl_remove(f, p);
        p->size += b->size;
        p->next = n;
        if (n) n->prev = p;
        drop_block(a, b);
        b = p;
    }
    if (n && n->state == ST_FREE) {
        fl_remove(f, n);
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        drop_block(a, n);
    }
    if (b->size == b->seg->size && a->c[C_FB_RESERVED] > a->fallback_limit) {
        Segment *s = b->seg;
        if (s->prev) s->prev->next = s->next; else a->segments = s->next;
        if (s->next) s->next->prev = s->prev;
        raw_free(a, (void *)(uintptr_t)s->addr, s->size);
        a->c[C_FB_RESERVED] -= s->size;
        free(s);
        drop_block(a, b);
        note_reserved(a);
        return;
    }
    fl_insert(f, b);
}

/* ---------- arena regions: live spans for the overlap check ---------- */

static size_t span_lower(Region *r, u64 off) {
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (r->spans[mid].off < off) lo = mid + 1; else hi = mid;
    }
    return lo;
}
/* 0 and the insertion done when [off, end) overlaps no span; 1 when it overlaps; -1 no memory */
static int span_claim(Region *r, u64 off, u64 end) {
    size_t i = span_lower(r, off);
    if (i > 0 && r->spans[i - 1].end > off) return 1;
    if (i < r->n && r->spans[i].off < end) return 1;
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 256;
        Span *s = (Span *)realloc(r->spans, cap * sizeof(Span));
        if (!s) return -1;
        r->spans = s;
        r->cap = cap;
    }
    memmove(r->spans + i + 1, r->spans + i, (r->n - i) * sizeof(Span));
    r->spans[i].off = off;
    r->spans[i].end = end;
    r->n++;
    return 0;
}
static void span_release(Region *r, u64 off) {
    size_t i = span_lower(r, off);
    if (i < r->n && r->spans[i].off == off) {
        memmove(r->spans + i, r->spans + i + 1, (r->n - i - 1) * sizeof(Span));
        r->n--;
    }
}
/* A range last used by another stream since the last synchronisation may still be in use there. */
static int dirty_for(Region *r, u64 off, u64 end, int sid) {
    if (r->dirty_all & ~(1ULL << sid)) return 1;
    for (size_t i = 0; i < r->nd; i++)
        if (r->dirty[i].stream != sid && r->dirty[i].off < end && off < r->dirty[i].end) return 1;
    return 0;
}
static void dirty_push(Region *r, u64 off, u64 end, int sid) {
    if (r->nd == r->capd) {
        size_t cap = r->capd ? r->capd * 2 : 256;
        Dirty *d = cap <= DIRTY_LIMIT ? (Dirty *)realloc(r->dirty, cap * sizeof(Dirty)) : NULL;
        if (!d) { r->dirty_all |= 1ULL << sid; return; }
        r->dirty = d;
        r->capd = cap;
    }
    r->dirty[r->nd].off = off;
    r->dirty[r->nd].end = end;
    r->dirty[r->nd++].stream = sid;
}
static void region_free(mpr_arena *a, Region *r) {
    raw_free(a, (void *)(uintptr_t)r->addr, r->size);
    free(r->dirty);
    free(r->spans);
    free(r);
}
static void region_unlink_retired(mpr_arena *a, Region *r) {
    Region **pp = &a->retired;
    while (*pp && *pp != r) pp = &(*pp)->next;
    if (*pp) *pp = r->next;
}

/* ---------- the recording log ---------- */

static int log_push(Log *l, u64 req, int stream, i64 start) {
    if (l->n == l->cap) {
        i64 cap = l->cap ? l->cap * 2 : 1024;
        u64 *q = (u64 *)realloc(l->req, cap * sizeof(u64));
        if (q) l->req = q;
        int *s = (int *)realloc(l->stream, cap * sizeof(int));
        if (s) l->stream = s;
        i64 *st = (i64 *)realloc(l->start, cap * sizeof(i64));
        if (st) l->start = st;
        i64 *en = (i64 *)realloc(l->end, cap * sizeof(i64));
        if (en) l->end = en;
        if (!q || !s || !st || !en) return -1;
        l->cap = cap;
    }
    l->req[l->n] = req;
    l->stream[l->n] = stream;
    l->start[l->n] = start;
    l->end[l->n] = END_LIVE;
    return (int)(l->n++ >= 0);
}

/* ---------- malloc / free ---------- */

static void trace_push(mpr_arena *a, unsigned char kind, i64 id, u64 size, i64 stream) {
    TraceBuf *t = &a->trace;
    if (t->n >= t->cap) return;
    t->kind[t->n] = kind;
    t->id[t->n] = id;
    t->size[t->n] = (i64)size;
    t->stream[t->n] = stream;
    t->step[t->n++] = (i64)a->c[C_STEPS];
}

static void count_alloc(mpr_arena *a, Block *b, u64 size) {
    b->requested = size;
    a->c[C_ALLOCS]++;
    a->c[C_BYTES] += size;
    a->c[C_LIVE] += size;
    if (a->c[C_LIVE] > a->c[C_PEAK_LIVE]) a->c[C_PEAK_LIVE] = a->c[C_LIVE];
}

static Block *arena_block(mpr_arena *a, Region *r, u64 off, u64 need, int sid);

static Block *arena_try(mpr_arena *a, u64 size, int sid) {
    if (a->active < 0) return NULL;
    Plan *p = &a->plans[a->active];
    u64 need = align_up(size, a->alignment), k = a->cursor, hit = NO_SLOT;
    /* the slot at the cursor when it recorded this size; else the next one that did (resync); else
     * the slot at the cursor when the size fits its window */
    for (u64 j = k; hit == NO_SLOT && j < p->n && j < k + WINDOW; j++)
        if (p->stream[j] == sid && p->req[j] == size) hit = j;
    if (hit == NO_SLOT && k < p->n && p->stream[k] == sid && p->size[k] >= need && p->offset[k] != NO_SLOT) hit = k;
    if (hit == NO_SLOT) { a->c[C_MISMATCH]++; return NULL; }
    a->c[C_SKIPPED] += hit - k;
    a->cursor = hit + 1;
    if (p->offset[hit] == NO_SLOT) { a->c[C_PLANNED_FB]++; return NULL; }
    Region *r = a->region;
    if (!r || p->offset[hit] + need > r->size) { a->c[C_OVERSIZE]++; return NULL; }
    u64 off = p->offset[hit];
    if (span_claim(r, off, off + need) != 0) {
        /* Requests of one size may come in another order than recorded (threads): a nearby slot of
         * the same size and stream that is free now serves instead. */
        u64 lo = hit > SWAP_WINDOW ? hit - SWAP_WINDOW : 0, alt = NO_SLOT;
        for (u64 j = lo; j < p->n && j <= hit + SWAP_WINDOW && alt == NO_SLOT; j++) {
            if (j == hit || p->stream[j] != sid || p->req[j] != size || p->offset[j] == NO_SLOT) continue;
            if (p->offset[j] + need <= r->size && span_claim(r, p->offset[j], p->offset[j] + need) == 0) alt = j;
        }
        if (alt == NO_SLOT) { a->c[C_OVERLAP]++; return NULL; }
        off = p->offset[alt];
        a->c[C_SWAPPED]++;
    }
    if (a->n_streams > 1 && dirty_for(r, off, off + need, sid)) {
        span_release(r, off);
        a->c[C_STREAM_WAIT]++;
        return NULL;
    }
    Block *b = arena_block(a, r, off, need, sid);
    if (!b) return NULL;
    a->c[C_REPLAYED]++;
    a->c[C_REPLAYED_BYTES] += size;
    return b;
}

static Block *arena_block(mpr_arena *a, Region *r, u64 off, u64 need, int sid) {
    Block *b = new_block(a);
    if (!b) { span_release(r, off); return NULL; }
    b->addr = r->addr + off;
    b->size = need;
    b->stream = sid;
    b->arena = 1;
    b->state = ST_LIVE;
    b->region = r;
    r->live++;
    a->c[C_ARENA_LIVE] += need;
    if (a->c[C_ARENA_LIVE] > a->c[C_ARENA_PEAK_LIVE]) a->c[C_ARENA_PEAK_LIVE] = a->c[C_ARENA_LIVE];
    return b;
}

/* While a step is recorded the arena's region is idle: the lowest gap that fits serves the request
 * (so recording a new signature does not hold the region and a whole step of fallback memory). */
static Block *arena_gap(mpr_arena *a, u64 size, int sid) {
    Region *r = a->region;
    if (!r) return NULL;
    u64 need = align_up(size, a->alignment), low = 0, off = NO_SLOT;
    for (size_t i = 0; i < r->n && off == NO_SLOT; i++) {
        if (r->spans[i].off >= low + need) off = low;
        else if (r->spans[i].end > low) low = r->spans[i].end;
    }
    if (off == NO_SLOT && r->size >= low + need) off = low;
    if (off == NO_SLOT) return NULL;
    if (a->n_streams > 1 && dirty_for(r, off, off + need, sid)) return NULL;
    if (span_claim(r, off, off + need) != 0) return NULL;
    Block *b = arena_block(a, r, off, need, sid);
    if (b) a->c[C_RECORDED_IN_ARENA]++;
    return b;
}

static Block *malloc_locked(mpr_arena *a, u64 size, i64 stream) {
    if (size == 0 || a->passthrough || a->closed) return NULL;
    int sid = stream_id(a, stream);
    if (sid < 0) return NULL;
    Block *b = a->active >= 0 ? arena_try(a, size, sid) : arena_gap(a, size, sid);
    if (b && a->active < 0) a->c[C_RECORDED]++;
    if (!b) {
        b = fallback_alloc(a, size, sid);
        if (!b) return NULL;
        if (a->active >= 0) { a->c[C_FB_ALLOCS]++; a->c[C_FB_BYTES] += size; }
        else a->c[C_RECORDED]++;
    }
    if (hash_put(a, b) != 0) return NULL;
    count_alloc(a, b, size);
    if (a->trace.cap) { b->trace_id = a->trace.next_id++; trace_push(a, 0, b->trace_id, size, stream); }
    if (a->active < 0 && a->cur.gen >= 0 && log_push(&a->cur, size, sid, a->cur.pos) > 0) {
        b->rec_gen = a->cur.gen;
        b->rec_idx = a->cur.n - 1;
    }
    a->cur.pos++;
    return b;
}

static void destroy(mpr_arena *a);

static void release_block(mpr_arena *a, Block *b) {
    if (b->arena) {
        Region *r = b->region;
        span_release(r, b->addr - r->addr);
        /* pushed even while one stream is known: a second stream may appear before the next sync */
        dirty_push(r, b->addr - r->addr, b->addr - r->addr + b->size, b->stream);
        a->c[C_ARENA_LIVE] -= b->size;
        if (--r->live == 0 && r != a->region) {
            region_unlink_retired(a, r);
            a->c[C_ARENA] -= r->size;
            region_free(a, r);
            note_reserved(a);
        }
        drop_block(a, b);
    } else {
        fallback_release(a, b);
    }
}

static int all_waits_done(mpr_arena *a, Block *b) {
    for (int i = 0; i < b->nwait; i++) if (a->completed[b->wait_stream[i]] < b->wait_marker[i]) return 0;
    return 1;
}

static void free_locked(mpr_arena *a, Block *b) {
    hash_del(a, b);
    if (a->trace.cap) trace_push(a, 1, b->trace_id, b->requested, a->stream_handle[b->stream]);
    a->c[C_LIVE] -= b->requested;
    if (b->rec_gen >= 0 && b->rec_gen == a->cur.gen && b->rec_idx < a->cur.n) a->cur.end[b->rec_idx] = a->cur.pos;
    else if (b->rec_gen >= 0 && b->rec_gen == a->prev.gen && b->rec_idx < a->prev.n) a->prev.end[b->rec_idx] = END_WRAP;
    a->cur.pos++;
    if (b->uses) {
        b->nwait = 0;
        for (int s = 0; s < a->n_streams && b->nwait < MAX_WAITS; s++) {
            if (!(b->uses >> s & 1)) continue;
            b->wait_stream[b->nwait] = s;
            b->wait_marker[b->nwait++] = ++a->issued[s];
        }
        b->state = ST_PENDING;
        b->pnext = a->pending;
        a->pending = b;
        a->c[C_PENDING]++;
        return;
    }
    release_block(a, b);
}

static u64 live_count(mpr_arena *a) { return a->n_blocks + a->c[C_PENDING]; }

/* ---------- public API ---------- */

static int load_cuda(mpr_arena *a, const char *lib, char *err, size_t errlen) {
    const char *names[] = {"libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", NULL};
    if (lib) a->lib = dlopen(lib, RTLD_NOW | RTLD_LOCAL); /* a path given: that library or none */
    for (int i = 0; !lib && names[i] && !a->lib; i++) a->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!a->lib) { snprintf(err, errlen, "cannot load the CUDA runtime library (%s)", lib ? lib : "libcudart.so"); return -1; }
    a->cuda_malloc = (int (*)(void **, size_t))dlsym(a->lib, "cudaMalloc");
    a->cuda_free = (int (*)(void *))dlsym(a->lib, "cudaFree");
    if (!a->cuda_malloc || !a->cuda_free) { snprintf(err, errlen, "the CUDA runtime library has no cudaMalloc/cudaFree"); return -1; }
    a->raw_alloc = cuda_alloc;
    a->raw_free = cuda_free_raw;
    return 0;
}

mpr_arena *mpr_create(int backend, const char *lib, u64 alignment, u64 fallback_limit, u64 arena_limit, char *err,
                      size_t errlen) {
    mpr_arena *a = (mpr_arena *)calloc(1, sizeof(mpr_arena));
    if (!a) { snprintf(err, errlen, "out of host memory"); return NULL; }
    pthread_mutex_init(&a->lock, NULL);
    a->backend = backend;
    a->alignment = alignment ? alignment : MIN_BLOCK;
    a->fallback_limit = fallback_limit;
    a->arena_limit = arena_limit;
    a->next_virtual = VIRTUAL_BASE;
    a->hugepages = 1;
    a->active = -1;
    a->prev.gen = -1;
    a->cur.gen = -1;
    a->ready.gen = -1;
    if (backend == BACKEND_VIRTUAL) { a->raw_alloc = virtual_alloc; a->raw_free = virtual_free; }
    else if (backend == BACKEND_HOST) { a->raw_alloc = host_alloc; a->raw_free = host_free; }
    else if (backend != BACKEND_CUDA || load_cuda(a, lib, err, errlen) != 0) {
        if (backend != BACKEND_CUDA) snprintf(err, errlen, "unknown backend %d", backend);
        if (a->lib) dlclose(a->lib);
        free(a);
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    a->next_global = g_all;
    g_all = a;
    pthread_mutex_unlock(&g_lock);
    return a;
}

void *mpr_malloc_block(mpr_arena *a, u64 size, i64 stream, void **handle) {
    pthread_mutex_lock(&a->lock);
    Block *b = malloc_locked(a, size, stream);
    pthread_mutex_unlock(&a->lock);
    if (handle) *handle = b;
    return b ? (void *)(uintptr_t)b->addr : NULL;
}
void *mpr_malloc(mpr_arena *a, u64 size, i64 stream) { return mpr_malloc_block(a, size, stream, NULL); }

/* Free through the handle mpr_malloc_block gave (the CPU allocator's DataPtr context). */
void mpr_free_block(void *handle) {
    Block *b = (Block *)handle;
    if (!b) return;
    mpr_arena *a = b->owner;
    pthread_mutex_lock(&a->lock);
    free_locked(a, b);
    int gone = a->closed && live_count(a) == 0;
    pthread_mutex_unlock(&a->lock);
    if (gone) destroy(a);
}

/* 0 freed; -1 not a block of this arena */
int mpr_free(mpr_arena *a, void *ptr) {
    pthread_mutex_lock(&a->lock);
    Block *b = hash_find(a, (u64)(uintptr_t)ptr);
    if (b) free_locked(a, b);
    int gone = a->closed && live_count(a) == 0;
    pthread_mutex_unlock(&a->lock);
    if (gone) destroy(a);
    return b ? 0 : -1;
}

int mpr_record_stream(mpr_arena *a, void *ptr, i64 stream) {
    pthread_mutex_lock(&a->lock);
    Block *b = hash_find(a, (u64)(uintptr_t)ptr);
    int sid = stream_id(a, stream), rc = -1;
    if (b && sid >= 0) { if (sid != b->stream) b->uses |= 1ULL << sid; rc = 0; }
    pthread_mutex_unlock(&a->lock);
    return rc;
}

/* The last marker issued on `stream` (frees waiting on it wait for a marker <= this). */
u64 mpr_stream_marker(mpr_arena *a, i64 stream) {
    pthread_mutex_lock(&a->lock);
    int sid = stream_id(a, stream);
    u64 m = sid >= 0 ? a->issued[sid] : 0;
    pthread_mutex_unlock(&a->lock);
    return m;
}

/* Report that `stream` reached `marker`; pending blocks whose waits are all done are released. */
u64 mpr_stream_complete(mpr_arena *a, i64 stream, u64 marker) {
    u64 released = 0;
    pthread_mutex_lock(&a->lock);
    int sid = stream_id(a, stream);
    if (sid >= 0 && marker > a->completed[sid]) a->completed[sid] = marker;
    for (Block **pp = &a->pending; *pp;) {
        Block *b = *pp;
        if (all_waits_done(a, b)) {
            *pp = b->pnext;
            a->c[C_PENDING]--;
            release_block(a, b);
            released++;
        } else {
            pp = &b->pnext;
        }
    }
    int gone = a->closed && live_count(a) == 0;
    pthread_mutex_unlock(&a->lock);
    if (gone) destroy(a);
    return released;
}

/* Every stream is idle (the device was synchronised): pending frees are released, no range is dirty. */
u64 mpr_synchronize(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    for (int s = 0; s < a->n_streams; s++) a->completed[s] = a->issued[s];
    u64 released = 0;
    while (a->pending) {
        Block *b = a->pending;
        a->pending = b->pnext;
        a->c[C_PENDING]--;
        release_block(a, b);
        released++;
    }
    if (a->region) { a->region->nd = 0; a->region->dirty_all = 0; }
    for (Region *r = a->retired; r; r = r->next) { r->nd = 0; r->dirty_all = 0; }
    int gone = a->closed && live_count(a) == 0;
    pthread_mutex_unlock(&a->lock);
    if (gone) destroy(a);
    return released;
}

/* Huge-page advice for the host arena's regions allocated from now on (on by default). */
void mpr_set_hugepages(mpr_arena *a, int on) {
    pthread_mutex_lock(&a->lock);
    a->hugepages = on != 0;
    pthread_mutex_unlock(&a->lock);
}

/* Add a plan (slots in request order); returns its id or -1. offset NO_SLOT: served by the fallback. */
int mpr_add_plan(mpr_arena *a, u64 n, const u64 *size, const u64 *req, const u64 *offset, const i64 *stream, u64 pool) {
    pthread_mutex_lock(&a->lock);
    int id = -1;
    if (a->n_plans == a->cap_plans) {
        int cap = a->cap_plans ? a->cap_plans * 2 : 16;
        Plan *p = (Plan *)realloc(a->plans, cap * sizeof(Plan));
        if (!p) goto done;
        a->plans = p;
        a->cap_plans = cap;
    }
    Plan *p = &a->plans[a->n_plans];
    p->n = n;
    p->pool = pool;
    p->size = (u64 *)malloc((n + 1) * sizeof(u64));
    p->req = (u64 *)malloc((n + 1) * sizeof(u64));
    p->offset = (u64 *)malloc((n + 1) * sizeof(u64));
    p->stream = (int *)malloc((n + 1) * sizeof(int));
    if (!p->size || !p->req || !p->offset || !p->stream) goto done;
    for (u64 i = 0; i < n; i++) {
        p->size[i] = align_up(size[i], a->alignment);
        p->req[i] = req[i];
        p->offset[i] = offset[i];
        int sid = stream_id(a, stream[i]);
        p->stream[i] = sid < 0 ? MAX_STREAMS : sid;
    }
    id = a->n_plans++;
    if (pool > a->c[C_PLANNED]) a->c[C_PLANNED] = pool;
done:
    pthread_mutex_unlock(&a->lock);
    return id;
}

/* A region of at least `need` bytes for the plans: 0 ok, 1 arena not allocated (limit or no memory). */
static int ensure_region(mpr_arena *a, u64 need) {
    if (a->region && a->region->size >= need) return 0;
    if (a->arena_limit && need > a->arena_limit) return 1;
    void *p = a->backend == BACKEND_HOST ? host_region_alloc(a, need) : a->raw_alloc(a, need);
    if (!p) return 1;
    a->c[C_RAW_ALLOCS]++;
    Region *r = (Region *)calloc(1, sizeof(Region));
    if (!r) { raw_free(a, p, need); return 1; }
    r->addr = (u64)(uintptr_t)p;
    r->size = need;
    if (a->region) {
        if (a->region->live == 0) { a->c[C_ARENA] -= a->region->size; region_free(a, a->region); }
        else { a->region->next = a->retired; a->retired = a->region; }
    }
    a->region = r;
    a->c[C_ARENA] += need;
    note_reserved(a);
    return 0;
}

/* Begin a step: plan < 0 records it; else replays plan. Returns 0, or 1 when the arena could not be
 * allocated: the arena then passes every request on (mpr_malloc gives NULL: the caller's own allocator). */
int mpr_begin_step(mpr_arena *a, int plan) {
    pthread_mutex_lock(&a->lock);
    int rc = 0;
    a->cursor = 0;
    a->active = -1;
    if (plan >= 0 && plan < a->n_plans) {
        if (ensure_region(a, a->plans[plan].pool) == 0) a->active = plan;
        else { rc = 1; a->passthrough = 1; a->c[C_ARENA_FAILED]++; }
    }
    if (a->active < 0) { a->cur.n = 0; a->cur.gen = ++a->gen; }
    else a->cur.gen = -1;
    a->cur.pos = 0;
    pthread_mutex_unlock(&a->lock);
    return rc;
}

static void swap_logs(Log *x, Log *y) { Log t = *x; *x = *y; *y = t; }

/* The log awaiting its next step becomes final now (blocks still live: END_LIVE). */
static i64 finalize_prev(mpr_arena *a) {
    if (a->prev.gen < 0) return -1;
    swap_logs(&a->ready, &a->prev);
    a->ready.gen = -1;
    a->prev.gen = -1;
    a->prev.n = 0;
    return a->ready.n;
}

/* End the step. The recording of the step before it (if any) becomes final and readable with
 * mpr_read_log; returns its number of requests, or -1. A recorded step waits for the next one. */
i64 mpr_end_step(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    a->c[C_STEPS]++;
    i64 ready = finalize_prev(a);
    if (a->cur.gen >= 0) {
        swap_logs(&a->prev, &a->cur);
        a->cur.n = 0;
        a->cur.gen = -1;
    }
    a->active = -1;
    pthread_mutex_unlock(&a->lock);
    return ready;
}

/* Finalize the last recording now, without waiting for another step; returns its length or -1. */
i64 mpr_finish(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    i64 ready = finalize_prev(a);
    pthread_mutex_unlock(&a->lock);
    return ready;
}

/* Copy a log: which 0, the final one (mpr_end_step's); which 1, the step just recorded, not final yet.
 * Per request: requested size, stream handle, start and end positions (END_WRAP -2: freed in the next
 * step, END_LIVE -1: still live after it, or not freed yet). */
i64 mpr_read_log(mpr_arena *a, int which, u64 *req, i64 *stream, i64 *start, i64 *end, i64 cap) {
    pthread_mutex_lock(&a->lock);
    Log *l = which ? &a->prev : &a->ready;
    i64 n = l->n < cap ? l->n : cap;
    for (i64 i = 0; i < n; i++) {
        req[i] = l->req[i];
        stream[i] = a->stream_handle[l->stream[i]];
        start[i] = l->start[i];
        end[i] = l->end[i];
    }
    pthread_mutex_unlock(&a->lock);
    return n;
}

/* Length of the step just recorded (-1 when the last step was not recorded). */
i64 mpr_recent_length(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    i64 n = a->prev.gen >= 0 ? a->prev.n : -1;
    pthread_mutex_unlock(&a->lock);
    return n;
}

/* Keep up to `cap` events (requests and frees) from now on; 0 ok, -1 no memory. */
int mpr_trace_enable(mpr_arena *a, i64 cap) {
    pthread_mutex_lock(&a->lock);
    TraceBuf *t = &a->trace;
    t->kind = (unsigned char *)malloc((size_t)cap);
    t->id = (i64 *)malloc((size_t)cap * sizeof(i64));
    t->size = (i64 *)malloc((size_t)cap * sizeof(i64));
    t->stream = (i64 *)malloc((size_t)cap * sizeof(i64));
    t->step = (i64 *)malloc((size_t)cap * sizeof(i64));
    int ok = t->kind && t->id && t->size && t->stream && t->step;
    t->cap = ok ? cap : 0;
    t->n = 0;
    pthread_mutex_unlock(&a->lock);
    return ok ? 0 : -1;
}

/* Copy the kept events: kind (0 request, 1 free), block id, requested bytes, stream, step. */
i64 mpr_trace_read(mpr_arena *a, unsigned char *kind, i64 *id, i64 *size, i64 *stream, i64 *step, i64 cap) {
    pthread_mutex_lock(&a->lock);
    TraceBuf *t = &a->trace;
    i64 n = t->n < cap ? t->n : cap;
    if (n > 0) {
        memcpy(kind, t->kind, (size_t)n);
        memcpy(id, t->id, (size_t)n * sizeof(i64));
        memcpy(size, t->size, (size_t)n * sizeof(i64));
        memcpy(stream, t->stream, (size_t)n * sizeof(i64));
        memcpy(step, t->step, (size_t)n * sizeof(i64));
    }
    pthread_mutex_unlock(&a->lock);
    return n;
}

i64 mpr_trace_length(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    i64 n = a->trace.n;
    pthread_mutex_unlock(&a->lock);
    return n;
}

void mpr_stats(mpr_arena *a, u64 *out, int n) {
    pthread_mutex_lock(&a->lock);
    for (int i = 0; i < n && i < N_COUNTERS; i++) out[i] = a->c[i];
    pthread_mutex_unlock(&a->lock);
}

int mpr_n_counters(void) { return N_COUNTERS; }

/* Peaks restart from the current values (a measurement window). */
void mpr_reset_peaks(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    a->c[C_PEAK_RESERVED] = a->c[C_RESERVED];
    a->c[C_FB_PEAK] = a->c[C_FB_RESERVED];
    a->c[C_PEAK_LIVE] = a->c[C_LIVE];
    a->c[C_ARENA_PEAK_LIVE] = a->c[C_ARENA_LIVE];
    pthread_mutex_unlock(&a->lock);
}

static void free_log(Log *l) { free(l->req); free(l->stream); free(l->start); free(l->end); }

static void destroy(mpr_arena *a) {
    pthread_mutex_lock(&g_lock);
    mpr_arena **pp = &g_all;
    while (*pp && *pp != a) pp = &(*pp)->next_global;
    if (*pp) *pp = a->next_global;
    if (g_current == a) g_current = NULL;
    pthread_mutex_unlock(&g_lock);
    for (Segment *s = a->segments, *nx; s; s = nx) { nx = s->next; raw_free(a, (void *)(uintptr_t)s->addr, s->size); free(s); }
    for (u64 i = 0; i < a->n_buckets; i++)
        for (Block *b = a->buckets[i], *nx; b; b = nx) { nx = b->hnext; free(b); }
    for (FreeList *f = &a->free_small; f <= &a->free_large; f++) {
        for (size_t i = 0; i < f->n; i++) free(f->items[i]);
        free(f->items);
    }
    for (Block *b = a->spare, *nx; b; b = nx) { nx = b->pnext; free(b); }
    if (a->region) region_free(a, a->region);
    for (Region *r = a->retired, *nx; r; r = nx) { nx = r->next; region_free(a, r); }
    for (int i = 0; i < a->n_plans; i++) {
        free(a->plans[i].size); free(a->plans[i].req); free(a->plans[i].offset); free(a->plans[i].stream);
    }
    free(a->plans);
    free(a->buckets);
    free_log(&a->cur); free_log(&a->prev); free_log(&a->ready);
    free(a->trace.kind); free(a->trace.id); free(a->trace.size); free(a->trace.stream); free(a->trace.step);
    if (a->lib) dlclose(a->lib);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

/* Close: no new requests (mpr_malloc gives NULL); the memory goes back when the last block is freed. */
void mpr_close(mpr_arena *a) {
    pthread_mutex_lock(&a->lock);
    a->closed = 1;
    int gone = live_count(a) == 0;
    pthread_mutex_unlock(&a->lock);
    if (gone) destroy(a);
}

/* ---------- CUDA pluggable allocator entry points (torch.cuda.memory.CUDAPluggableAllocator) ---------- */

void mpr_set_current(mpr_arena *a) {
    pthread_mutex_lock(&g_lock);
    g_current = a;
    pthread_mutex_unlock(&g_lock);
}

void *mpr_cuda_malloc(size_t size, int device, void *stream) {
    (void)device;
    mpr_arena *a = g_current;
    return a ? mpr_malloc(a, (u64)size, (i64)(intptr_t)stream) : NULL;
}

/* Free a block of whichever arena holds it (the CPU allocator's deleter: its context is the pointer).
 * The block is freed under the lock that found it: one hash look-up, no second locking. */
void mpr_free_any(void *ptr) {
    pthread_mutex_lock(&g_lock);
    mpr_arena *gone = NULL;
    for (mpr_arena *a = g_all; a; a = a->next_global) {
        pthread_mutex_lock(&a->lock);
        Block *b = hash_find(a, (u64)(uintptr_t)ptr);
        if (b) {
            free_locked(a, b);
            if (a->closed && live_count(a) == 0) gone = a;
        }
        pthread_mutex_unlock(&a->lock);
        if (b) break;
    }
    pthread_mutex_unlock(&g_lock);
    if (gone) destroy(gone);
}

void mpr_cuda_free(void *ptr, size_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    mpr_free_any(ptr);
}
