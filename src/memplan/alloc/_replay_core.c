/* Replay core of memplan.doctor.replay: CachingAllocator's malloc/free over a whole trace, in C.
 *
 * The rules are those of memplan.alloc.allocator.CachingAllocator and memplan.alloc.expandable
 * (the pure-Python model, itself following c10/cuda/CUDACachingAllocator.cpp): 512-byte rounding
 * and roundup_power2_divisions; small (<= 1 MiB) and large pools; best fit by (stream, size,
 * address); should_split with max_split_size; the oversize rules; coalescing on free;
 * garbage_collection_threshold; expandable segments; at a capacity, free one oversize block /
 * free all cached blocks and retry, then out of memory. Every function names the Python one it
 * mirrors; a hypothesis test (tests/doctor/test_replay_native.py) checks both give the same
 * result on random traces at random settings.
 *
 * replay(events, alloc_kind, max_split, divisions, gc_threshold, expandable, capacity)
 *   events: a sequence of AllocEvent named tuples (kind at 1, block at 2, size at 3, stream at 9);
 *   alloc_kind: the string an allocation's kind equals (every other kind is a free);
 *   max_split: max_split_size; divisions: the 16 roundup_power2_divisions; capacity: None or bytes.
 * -> (events_replayed, peak_reserved, peak_allocated, reserved, allocated, largest_free_block, oom) with oom None or (event_index, requested, alloc_size, reserved, allocated);
 * shape(events, alloc_kind) -> (run_starts, same_as_previous): memplan.doctor.replay.trace_shape's
 * answer, or None for iterations, block ids, sizes or streams that are not 64-bit ints.
 *
 * schedule(ops, max_split, divisions, gc_threshold, expandable, capacity)
 *   ops: a list of ints, one per event: an allocation is size << 8 | stream (stream 0..255), a free is
 *   ~position (the bitwise not of the position of the allocation it frees in ops);
 * -> (peak_reserved, peak_allocated, reserved, allocated, oom_at) with oom_at -1 or the position of the
 *    allocation that ran out of memory (the replay stops there): memplan.alloc.schedule's answer, or None for
 *    an op it does not handle (not a 64-bit int, a size of 2**50 or more, a free of no live allocation).
 *
 * repeat_copies(ops, template_ops, outside_at, sides, sizes, result, base)
 *   copies of a recorded stretch appended to ops: memplan.alloc.schedule.repeat_copies's answer, or None
 *   (ops unchanged) when a side's sizes differ or an op is not a 64-bit int.
 *
 * replay -> None when the trace is outside what this core handles (a block id or stream that is not a
 *    64-bit int, a size that is negative or 2**50 or more, a free of a block not allocated): the
 *    caller then replays in Python, which gives its own answer (or error) for such a trace.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t u64;
typedef int64_t i64;

#define K_MIN_BLOCK_SIZE 512ULL
#define K_SMALL_SIZE (1ULL << 20)
#define K_SMALL_BUFFER (2ULL << 20)
#define K_LARGE_BUFFER (20ULL << 20)
#define K_MIN_LARGE_ALLOC (10ULL << 20)
#define K_ROUND_LARGE (2ULL << 20)
#define ADDRESS_ALIGNMENT (2ULL << 20)
#define NO_MAX_SPLIT UINT64_MAX
#define FIRST_ADDRESS 0x7F0000000000ULL
#define UNLIMITED_ADDRESS_SPACE (1ULL << 44)
#define SIZE_LIMIT (1ULL << 50)
#define STREAM_LIMIT (1LL << 40)
#define ROUNDUP_INTERVALS 16
#define SCHEDULE_STREAM_BITS 8

typedef struct Block {
    u64 address, size, requested, gc_base, seg_address;
    i64 stream;
    struct Block *prev, *next;
    unsigned char small, allocated, mapped;
    struct Block *free_next; /* the free list of Block structs */
} Block;

typedef struct {
    Block **items;
    size_t n, cap;
    int by_address; /* 0: (stream, size, address) order; 1: (stream, address) (unmapped ranges) */
} Pool;

typedef struct { /* int64 -> int64 (a Block pointer in the replay, a run and offset in the shape) */
    i64 *keys;
    i64 *values;
    unsigned char *used;
    size_t cap, n;
} LiveMap;

typedef struct {
    Pool small_free, large_free, small_unmapped, large_unmapped;
    u64 small_calls, large_calls; /* free_calls of each pool (the GC clock) */
    u64 reserved, allocated, requested, next_address;
    u64 max_split, capacity;
    int has_capacity, gc, expandable, plain_rounding, nomem, unsupported;
    double gc_threshold;
    long divisions[ROUNDUP_INTERVALS];
    Block *spare;             /* free list of Block structs */
    void **chunks;            /* every chunk of Block structs, freed at the end */
    size_t n_chunks, cap_chunks;
} Alloc;

/* ------------------------------------------------------------------------------------------ */
/* Block structs */

static Block *new_block(Alloc *a, u64 address, u64 size, i64 stream, int small, u64 seg_address) {
    if (a->spare == NULL) {
        size_t count = 256;
        Block *chunk = malloc(count * sizeof(Block));
        if (chunk == NULL) {
            a->nomem = 1;
            return NULL;
        }
        if (a->n_chunks == a->cap_chunks) {
            size_t cap = a->cap_chunks ? 2 * a->cap_chunks : 16;
            void **chunks = realloc(a->chunks, cap * sizeof(void *));
            if (chunks == NULL) {
                free(chunk);
                a->nomem = 1;
                return NULL;
            }
            a->chunks = chunks;
            a->cap_chunks = cap;
        }
        a->chunks[a->n_chunks++] = chunk;
        for (size_t i = 0; i < count; i++) {
            chunk[i].free_next = a->spare;
            a->spare = &chunk[i];
        }
    }
    Block *b = a->spare;
    a->spare = b->free_next;
    b->address = address;
    b->size = size;
    b->requested = 0;
    b->gc_base = 0;
    b->seg_address = seg_address;
    b->stream = stream;
    b->prev = b->next = NULL;
    b->small = (unsigned char)small;
    b->allocated = 0;
    b->mapped = 1;
    return b;
}

static void drop_block(Alloc *a, Block *b) {
    b->free_next = a->spare;
    a->spare = b;
}

static int is_split(const Block *b) { return b->prev != NULL || b->next != NULL; }

/* ------------------------------------------------------------------------------------------ */
/* Pools: sorted arrays (BlockPool.keys / unmapped_keys) */

/* <0, 0, >0 as block b orders before, at, after the key (stream, size, address). */
static int cmp_key(const Pool *p, const Block *b, i64 stream, u64 size, u64 address) {
    if (b->stream != stream)
        return b->stream < stream ? -1 : 1;
    if (!p->by_address && b->size != size)
        return b->size < size ? -1 : 1;
    if (b->address != address)
        return b->address < address ? -1 : 1;
    return 0;
}

/* First index whose block is not before (stream, size, address) (bisect_left). */
static size_t lower_bound(const Pool *p, i64 stream, u64 size, u64 address) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cmp_key(p, p->items[mid], stream, size, address) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int pool_put(Alloc *a, Pool *p, Block *b) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 64;
        Block **items = realloc(p->items, cap * sizeof(Block *));
        if (items == NULL) {
            a->nomem = 1;
            return -1;
        }
        p->items = items;
        p->cap = cap;
    }
    size_t at = lower_bound(p, b->stream, b->size, b->address);
    memmove(p->items + at + 1, p->items + at, (p->n - at) * sizeof(Block *));
    p->items[at] = b;
    p->n++;
    return 0;
}

static void pool_take_at(Pool *p, size_t at) {
    memmove(p->items + at, p->items + at + 1, (p->n - at - 1) * sizeof(Block *));
    p->n--;
}

static void pool_take(Pool *p, const Block *b) { pool_take_at(p, lower_bound(p, b->stream, b->size, b->address)); }

static Pool *free_pool(Alloc *a, int small) { return small ? &a->small_free : &a->large_free; }
static Pool *unmapped_pool(Alloc *a, int small) { return small ? &a->small_unmapped : &a->large_unmapped; }
static u64 *free_calls(Alloc *a, int small) { return small ? &a->small_calls : &a->large_calls; }

/* BlockPool.insert: a free mapped block, its GC age restarted. */
static void insert(Alloc *a, Block *b) {
    b->gc_base = *free_calls(a, b->small);
    pool_put(a, free_pool(a, b->small), b);
}

/* ------------------------------------------------------------------------------------------ */
/* Blocks by id (the replay's ``live``, the shape's ``where``): linear probing, backward-shift deletion */

static size_t slot_of(const LiveMap *m, i64 key) {
    u64 h = (u64)key * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 17) & (m->cap - 1);
}

static int live_grow(LiveMap *m) {
    size_t cap = m->cap ? 2 * m->cap : 1024;
    LiveMap bigger = {calloc(cap, sizeof(i64)), calloc(cap, sizeof(i64)), calloc(cap, 1), cap, 0};
    if (bigger.keys == NULL || bigger.values == NULL || bigger.used == NULL) {
        free(bigger.keys);
        free(bigger.values);
        free(bigger.used);
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->used[i])
            continue;
        size_t s = slot_of(&bigger, m->keys[i]);
        while (bigger.used[s])
            s = (s + 1) & (cap - 1);
        bigger.used[s] = 1;
        bigger.keys[s] = m->keys[i];
        bigger.values[s] = m->values[i];
        bigger.n++;
    }
    free(m->keys);
    free(m->values);
    free(m->used);
    *m = bigger;
    return 0;
}

static int live_set(LiveMap *m, i64 key, i64 value) {
    if (2 * (m->n + 1) > m->cap && live_grow(m) < 0)
        return -1;
    size_t s = slot_of(m, key);
    while (m->used[s] && m->keys[s] != key)
        s = (s + 1) & (m->cap - 1);
    if (!m->used[s]) {
        m->used[s] = 1;
        m->keys[s] = key;
        m->n++;
    }
    m->values[s] = value;
    return 0;
}

/* Removes key; 1 and its value in *value when it was there, else 0. */
static int live_pop(LiveMap *m, i64 key, i64 *value) {
    if (m->cap == 0)
        return 0;
    size_t mask = m->cap - 1, s = slot_of(m, key);
    while (m->used[s] && m->keys[s] != key)
        s = (s + 1) & mask;
    if (!m->used[s])
        return 0;
    *value = m->values[s];
    size_t hole = s, j = s;
    for (;;) { /* shift back the entries whose probe run crosses the hole */
        j = (j + 1) & mask;
        if (!m->used[j])
            break;
        size_t home = slot_of(m, m->keys[j]);
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            m->keys[hole] = m->keys[j];
            m->values[hole] = m->values[j];
            hole = j;
        }
    }
    m->used[hole] = 0;
    m->n--;
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Sizes (round_size, allocation_size) */

static int bit_length(u64 x) { return x ? 64 - __builtin_clzll(x) : 0; }

static u64 round_size(const Alloc *a, u64 size) {
    if (size < K_MIN_BLOCK_SIZE)
        return K_MIN_BLOCK_SIZE;
    if (!a->plain_rounding) {
        int index = bit_length(size) - 1 - 20;
        index = index < 0 ? 0 : (index > ROUNDUP_INTERVALS - 1 ? ROUNDUP_INTERVALS - 1 : index);
        long divisions = a->divisions[index];
        if (divisions > 1 && size > K_MIN_BLOCK_SIZE * (u64)divisions) {
            if ((size & (size - 1)) == 0)
                return size;
            u64 floor = 1ULL << (bit_length(size) - 1);
            u64 step = floor >> (bit_length((u64)divisions) - 1);
            if (step == 0)
                return floor << 1;
            u64 low = size & ~(step - 1);
            return low == size ? size : low + step;
        }
    }
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) / K_MIN_BLOCK_SIZE);
}

static u64 allocation_size(u64 size) {
    if (size <= K_SMALL_SIZE)
        return K_SMALL_BUFFER;
    if (size < K_MIN_LARGE_ALLOC)
        return K_LARGE_BUFFER;
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) / K_ROUND_LARGE);
}

/* ------------------------------------------------------------------------------------------ */
/* Segments */

static u64 new_address(Alloc *a, u64 size) {
    u64 address = a->next_address;
    a->next_address += (size + ADDRESS_ALIGNMENT - 1) / ADDRESS_ALIGNMENT * ADDRESS_ALIGNMENT + ADDRESS_ALIGNMENT;
    return address;
}

/* _fits */
static int fits(const Alloc *a, u64 size) { return !a->has_capacity || a->reserved + size <= a->capacity; }

/* _try_merge */
static void try_merge(Alloc *a, Block *dst, Block *src) {
    if (src == NULL || src->allocated || src->mapped != dst->mapped)
        return;
    pool_take(src->mapped ? free_pool(a, src->small) : unmapped_pool(a, src->small), src);
    if (dst->prev == src) {
        dst->address = src->address;
        dst->prev = src->prev;
        if (dst->prev != NULL)
            dst->prev->next = dst;
    } else {
        dst->next = src->next;
        if (dst->next != NULL)
            dst->next->prev = dst;
    }
    dst->size += src->size;
    drop_block(a, src);
}

static void splice(Block *b, Block *before, Block *after) {
    b->prev = before;
    if (before != NULL)
        before->next = b;
    b->next = after;
    if (after != NULL)
        after->prev = b;
}

/* expandable._find_expandable_block */
static Block *find_expandable_block(Alloc *a, int small, i64 stream, u64 size) {
    Pool *unmapped = unmapped_pool(a, small);
    for (size_t i = lower_bound(unmapped, stream, 0, 0); i < unmapped->n && unmapped->items[i]->stream == stream; i++) {
        Block *candidate = unmapped->items[i];
        Block *start = candidate->prev != NULL && !candidate->prev->allocated ? candidate->prev : candidate;
        u64 total = 0;
        for (Block *b = start; total < size && b != NULL && !b->allocated; b = b->next)
            total += b->size;
        if (total >= size)
            return start;
    }
    u64 space = a->has_capacity && a->capacity ? a->capacity + a->capacity / 8 : UNLIMITED_ADDRESS_SPACE;
    u64 address = new_address(a, space);
    Block *b = new_block(a, address, space, stream, small, address);
    if (b == NULL)
        return NULL;
    b->mapped = 0;
    pool_put(a, unmapped, b);
    return b;
}

/* expandable._map_block */
static int map_block(Alloc *a, Block *b, u64 size) {
    u64 page = b->small ? K_SMALL_BUFFER : K_LARGE_BUFFER;
    u64 offset = b->address - b->seg_address;
    u64 first = offset / page, end = (offset + size + page - 1) / page;
    u64 mapped = (end - first) * page;
    if (!fits(a, mapped))
        return 0;
    pool_take(unmapped_pool(a, b->small), b);
    b->mapped = 1;
    if (mapped < b->size) {
        Block *rest = new_block(a, b->address + mapped, b->size - mapped, b->stream, b->small, b->seg_address);
        if (rest == NULL)
            return 0;
        rest->mapped = 0;
        splice(rest, b, b->next);
        pool_put(a, unmapped_pool(a, b->small), rest);
        b->size = mapped;
    }
    try_merge(a, b, b->prev);
    try_merge(a, b, b->next);
    insert(a, b);
    a->reserved += mapped;
    return 1;
}

/* expandable.try_allocate_expandable_block */
static Block *try_allocate_expandable_block(Alloc *a, int small, i64 stream, u64 size) {
    Block *candidate = find_expandable_block(a, small, stream, size);
    if (candidate == NULL)
        return NULL;
    if (!candidate->mapped && !map_block(a, candidate, candidate->size < size ? candidate->size : size))
        return NULL;
    while (candidate->size < size) {
        Block *following = candidate->next;
        if (following == NULL || following->mapped) { /* the Python model asserts this never happens */
            a->unsupported = 1;
            return NULL;
        }
        u64 want = size - candidate->size;
        if (!map_block(a, following, want < following->size ? want : following->size))
            return NULL;
        candidate = following;
    }
    pool_take(free_pool(a, small), candidate);
    return candidate;
}

/* _alloc_block */
static Block *alloc_block(Alloc *a, int small, i64 stream, u64 size, u64 alloc_size) {
    if (a->expandable)
        return try_allocate_expandable_block(a, small, stream, size);
    if (!fits(a, alloc_size))
        return NULL;
    u64 address = new_address(a, alloc_size);
    a->reserved += alloc_size;
    return new_block(a, address, alloc_size, stream, small, address);
}

/* _release_block */
static void release_block(Alloc *a, Pool *p, size_t at) {
    Block *b = p->items[at];
    pool_take_at(p, at);
    a->reserved -= b->size;
    drop_block(a, b);
}

/* _release_available_cached_blocks */
static int release_available_cached_blocks(Alloc *a, int small, i64 stream, u64 size) {
    if (a->max_split == NO_MAX_SPLIT)
        return 0;
    Pool *p = free_pool(a, small);
    u64 target = size > a->max_split ? size : a->max_split;
    size_t index = lower_bound(p, stream, target, 0);
    if (index < p->n && p->items[index]->stream == stream) {
        if (is_split(p->items[index]) || a->expandable)
            return 0;
        release_block(a, p, index);
        return 1;
    }
    if (index == 0)
        return 0;
    u64 released = 0;
    for (size_t i = index; i-- > 0 && released < target;) {
        Block *b = p->items[i];
        if (b->size < a->max_split || b->stream != stream)
            break;
        released += b->size;
        if (!is_split(b) && !a->expandable)
            release_block(a, p, i);
    }
    return released >= target;
}

/* expandable._unmap_block */
static void unmap_block(Alloc *a, Block *b) {
    u64 page = b->small ? K_SMALL_BUFFER : K_LARGE_BUFFER;
    u64 base = b->seg_address, offset = b->address - base;
    u64 first = (offset + page - 1) / page, end = (offset + b->size) / page;
    if (first >= end)
        return;
    u64 start = base + first * page, length = (end - first) * page;
    pool_take(free_pool(a, b->small), b);
    u64 before = start - b->address;
    if (before > 0) {
        Block *head = new_block(a, b->address, before, b->stream, b->small, b->seg_address);
        if (head == NULL)
            return;
        splice(head, b->prev, b);
        insert(a, head);
    }
    u64 after = b->size - before - length;
    if (after > 0) {
        Block *tail = new_block(a, start + length, after, b->stream, b->small, b->seg_address);
        if (tail == NULL)
            return;
        splice(tail, b, b->next);
        insert(a, tail);
    }
    b->address = start;
    b->size = length;
    b->mapped = 0;
    try_merge(a, b, b->prev);
    try_merge(a, b, b->next);
    pool_put(a, unmapped_pool(a, b->small), b);
    a->reserved -= length;
}

/* _release_cached_blocks (with expandable.release_expandable_blocks) */
static void release_cached_blocks(Alloc *a) {
    for (int small = 0; small <= 1; small++) {
        Pool *p = free_pool(a, small);
        size_t n = p->n;
        if (n == 0)
            continue;
        Block **snapshot = malloc(n * sizeof(Block *));
        if (snapshot == NULL) {
            a->nomem = 1;
            return;
        }
        memcpy(snapshot, p->items, n * sizeof(Block *));
        if (a->expandable) {
            for (size_t i = 0; i < n; i++) {
                Block *b = snapshot[i];
                unmap_block(a, b);
                if (!b->mapped && !is_split(b)) {
                    pool_take(unmapped_pool(a, small), b);
                    drop_block(a, b);
                }
            }
        } else {
            for (size_t i = 0; i < n; i++)
                if (!is_split(snapshot[i]))
                    release_block(a, p, lower_bound(p, snapshot[i]->stream, snapshot[i]->size, snapshot[i]->address));
        }
        free(snapshot);
    }
}

/* _garbage_collect */
static void garbage_collect(Alloc *a) {
    u64 threshold = (u64)(a->gc_threshold * (double)a->capacity);
    if (a->reserved <= threshold)
        return;
    u64 target = a->reserved - threshold;
    Pool *p = &a->large_free;
    u64 clock = a->large_calls, total_age = 0, count = 0;
    for (size_t i = 0; i < p->n; i++)
        if (!is_split(p->items[i])) {
            total_age += clock - p->items[i]->gc_base;
            count++;
        }
    if (count == 0)
        return;
    u64 reclaimed = 0;
    int freed_one = 1;
    while (reclaimed < target && freed_one && count > 0) {
        double age_threshold = (double)total_age / (double)count;
        freed_one = 0;
        size_t n = p->n;
        Block **snapshot = malloc(n * sizeof(Block *));
        if (snapshot == NULL) {
            a->nomem = 1;
            return;
        }
        memcpy(snapshot, p->items, n * sizeof(Block *));
        for (size_t i = 0; i < n; i++) {
            Block *b = snapshot[i];
            if (is_split(b) || a->expandable)
                continue;
            u64 age = clock - b->gc_base;
            if ((double)age >= age_threshold) {
                freed_one = 1;
                reclaimed += b->size;
                total_age -= age;
                count--;
                release_block(a, p, lower_bound(p, b->stream, b->size, b->address));
            }
        }
        free(snapshot);
    }
}

/* _get_free_block (with _best_expandable); the block returned is out of its pool. */
static Block *get_free_block(Alloc *a, int small, i64 stream, u64 size) {
    Pool *p = free_pool(a, small);
    if (a->gc)
        (*free_calls(a, small))++;
    size_t index = lower_bound(p, stream, size, 0);
    if (index >= p->n || p->items[index]->stream != stream)
        return NULL;
    Block *b = p->items[index];
    if (a->expandable) {
        /* best fit counts the unmapped space that follows a block */
#define EXPANDABLE_SIZE(x) ((x)->size + ((x)->next != NULL && !(x)->next->mapped ? (x)->next->size : 0))
        for (size_t next = index + 1; next < p->n && p->items[next]->stream == stream; next++) {
            Block *candidate = p->items[next];
            if (EXPANDABLE_SIZE(candidate) >= EXPANDABLE_SIZE(b))
                break;
            b = candidate;
            index = next;
        }
#undef EXPANDABLE_SIZE
    }
    u64 max_split = a->max_split;
    if (size < max_split && max_split <= b->size)
        return NULL;
    if (size >= max_split && b->size >= size + K_LARGE_BUFFER)
        return NULL;
    pool_take_at(p, index);
    return b;
}

/* _should_split */
static int should_split(const Alloc *a, const Block *b, u64 size) {
    u64 remaining = b->size - size;
    if (b->small || a->expandable)
        return remaining >= K_MIN_BLOCK_SIZE;
    return size < a->max_split && remaining > K_SMALL_SIZE;
}

/* malloc: the block, or NULL with *oom_alloc_size set (out of memory) or a->nomem. */
static Block *alloc_malloc(Alloc *a, u64 orig_size, i64 stream, u64 *oom_alloc_size) {
    u64 size = round_size(a, orig_size);
    int small = size <= K_SMALL_SIZE;
    Block *b = get_free_block(a, small, stream, size);
    if (b == NULL) {
        u64 alloc_size = allocation_size(size);
        if (a->gc)
            garbage_collect(a);
        b = alloc_block(a, small, stream, size, alloc_size);
        if (b == NULL && !a->nomem && !a->unsupported && release_available_cached_blocks(a, small, stream, size))
            b = alloc_block(a, small, stream, size, alloc_size);
        if (b == NULL && !a->nomem && !a->unsupported) {
            release_cached_blocks(a);
            b = alloc_block(a, small, stream, size, alloc_size);
        }
        if (b == NULL) {
            *oom_alloc_size = alloc_size;
            return NULL;
        }
    }
    if (should_split(a, b, size)) { /* _split: the request takes the low addresses */
        Block *head = new_block(a, b->address, size, b->stream, b->small, b->seg_address);
        if (head == NULL)
            return NULL;
        head->prev = b->prev;
        if (head->prev != NULL)
            head->prev->next = head;
        head->next = b;
        b->prev = head;
        b->address += size;
        b->size -= size;
        insert(a, b);
        b = head;
    }
    b->allocated = 1;
    b->requested = orig_size;
    a->allocated += b->size;
    a->requested += orig_size;
    return b;
}

/* free */
static void alloc_free(Alloc *a, Block *b) {
    b->allocated = 0;
    a->allocated -= b->size;
    a->requested -= b->requested;
    Block *prev = b->prev, *next = b->next;
    if (prev != NULL && !prev->allocated)
        try_merge(a, b, prev);
    if (next != NULL && !next->allocated)
        try_merge(a, b, next);
    insert(a, b);
}

/* ------------------------------------------------------------------------------------------ */
/* The replay loop */

static int as_i64(PyObject *obj, i64 *out) {
    if (!PyLong_Check(obj))
        return 0;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = value;
    return 1;
}

static void alloc_release(Alloc *a, LiveMap *live) {
    for (size_t i = 0; i < a->n_chunks; i++)
        free(a->chunks[i]);
    free(a->chunks);
    free(a->small_free.items);
    free(a->large_free.items);
    free(a->small_unmapped.items);
    free(a->large_unmapped.items);
    free(live->keys);
    free(live->values);
    free(live->used);
}

/* The settings (AllocatorSettings' fields) into a fresh allocator: 0, -1 with an exception set, or 1 for a
 * capacity this core does not handle. */
static int alloc_setup(Alloc *a, unsigned long long max_split, PyObject *divisions_obj, double gc_threshold,
                       int expandable, PyObject *capacity_obj) {
    memset(a, 0, sizeof *a);
    a->small_unmapped.by_address = a->large_unmapped.by_address = 1;
    a->max_split = max_split;
    a->expandable = expandable;
    a->gc_threshold = gc_threshold;
    a->next_address = FIRST_ADDRESS;
    a->plain_rounding = 1;
    PyObject *divisions = PySequence_Fast(divisions_obj, "divisions must be a sequence");
    if (divisions == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(divisions) != ROUNDUP_INTERVALS) {
        Py_DECREF(divisions);
        PyErr_SetString(PyExc_ValueError, "divisions must have 16 values");
        return -1;
    }
    for (int i = 0; i < ROUNDUP_INTERVALS; i++) {
        a->divisions[i] = PyLong_AsLong(PySequence_Fast_GET_ITEM(divisions, i));
        if (a->divisions[i] > 1)
            a->plain_rounding = 0;
    }
    Py_DECREF(divisions);
    if (PyErr_Occurred())
        return -1;
    if (capacity_obj != Py_None) {
        i64 capacity;
        if (!as_i64(capacity_obj, &capacity) || capacity < 0)
            return 1;
        a->has_capacity = 1;
        a->capacity = (u64)capacity;
    }
    a->gc = a->has_capacity && gc_threshold > 0.0;
    return 0;
}

/* The settings at args[first:] (max_split, divisions, gc_threshold, expandable, capacity) into a fresh
 * allocator: alloc_setup's answer, or -1 with an exception set for arguments of the wrong count or type. */
static int settings_from(PyObject *args, Py_ssize_t first, Py_ssize_t count, Alloc *a) {
    if (PyTuple_GET_SIZE(args) != count) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments", count);
        return -1;
    }
    PyObject *rest = PyTuple_GetSlice(args, first, count);
    if (rest == NULL)
        return -1;
    PyObject *divisions_obj, *capacity_obj;
    unsigned long long max_split;
    double gc_threshold;
    int expandable;
    int out = -1;
    if (PyArg_ParseTuple(rest, "KOdpO", &max_split, &divisions_obj, &gc_threshold, &expandable, &capacity_obj))
        out = alloc_setup(a, max_split, divisions_obj, gc_threshold, expandable, capacity_obj);
    Py_DECREF(rest);
    return out;
}

static PyObject *replay(PyObject *self, PyObject *args) {
    Alloc a;
    int setup = settings_from(args, 2, 7, &a);
    if (setup < 0)
        return NULL;
    if (setup > 0)
        Py_RETURN_NONE;
    PyObject *events_obj = PyTuple_GET_ITEM(args, 0), *kind_alloc = PyTuple_GET_ITEM(args, 1);

    PyObject *events = PySequence_Fast(events_obj, "events must be a sequence");
    if (events == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(events);
    PyObject **items = PySequence_Fast_ITEMS(events);
    LiveMap live = {NULL, NULL, NULL, 0, 0};
    u64 peak_r = 0, peak_a = 0, oom_alloc_size = 0;
    Py_ssize_t replayed = 0, oom_at = -1;
    u64 oom_size = 0;
    int unsupported = 0;
    for (Py_ssize_t position = 0; position < n; position++) {
        PyObject *event = items[position];
        if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) < 10) {
            unsupported = 1;
            break;
        }
        i64 block_id;
        if (!as_i64(PyTuple_GET_ITEM(event, 2), &block_id)) {
            unsupported = 1;
            break;
        }
        int is_alloc = PyObject_RichCompareBool(PyTuple_GET_ITEM(event, 1), kind_alloc, Py_EQ);
        if (is_alloc < 0)
            goto error;
        if (is_alloc) {
            i64 size, stream;
            if (!as_i64(PyTuple_GET_ITEM(event, 3), &size) || size < 0 || (u64)size >= SIZE_LIMIT
                || !as_i64(PyTuple_GET_ITEM(event, 9), &stream) || stream <= -STREAM_LIMIT || stream >= STREAM_LIMIT) {
                unsupported = 1;
                break;
            }
            Block *b = alloc_malloc(&a, (u64)size, stream, &oom_alloc_size);
            if (a.nomem)
                goto nomem;
            if (a.unsupported) {
                unsupported = 1;
                break;
            }
            if (b == NULL) {
                oom_at = position;
                oom_size = (u64)size;
                break;
            }
            if (live_set(&live, block_id, (i64)(intptr_t)b) < 0)
                goto nomem;
            if (a.allocated > peak_a)
                peak_a = a.allocated;
            if (a.reserved > peak_r)
                peak_r = a.reserved;
        } else {
            i64 found;
            if (!live_pop(&live, block_id, &found)) {
                unsupported = 1;
                break;
            }
            alloc_free(&a, (Block *)(intptr_t)found);
            if (a.nomem)
                goto nomem;
        }
        replayed = position + 1;
    }
    Py_DECREF(events);
    if (unsupported) {
        alloc_release(&a, &live);
        Py_RETURN_NONE;
    }
    u64 largest = 0;
    for (int small = 0; small <= 1; small++) {
        Pool *p = free_pool(&a, small);
        for (size_t i = 0; i < p->n; i++)
            if (p->items[i]->size > largest)
                largest = p->items[i]->size;
    }
    PyObject *oom;
    if (oom_at >= 0)
        oom = Py_BuildValue("(nKKKK)", oom_at, (unsigned long long)oom_size, (unsigned long long)oom_alloc_size,
                            (unsigned long long)a.reserved, (unsigned long long)a.allocated);
    else
        oom = Py_NewRef(Py_None);
    alloc_release(&a, &live);
    if (oom == NULL)
        return NULL;
    return Py_BuildValue("(nKKKKKN)", replayed, (unsigned long long)peak_r, (unsigned long long)peak_a,
                         (unsigned long long)a.reserved, (unsigned long long)a.allocated, (unsigned long long)largest,
                         oom);
nomem:
    Py_DECREF(events);
    alloc_release(&a, &live);
    return PyErr_NoMemory();
error:
    Py_DECREF(events);
    alloc_release(&a, &live);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* A schedule of plain ints (memplan.alloc.schedule) */

/* schedule(ops, max_split, divisions, gc_threshold, expandable, capacity): see the module comment. */
static PyObject *schedule(PyObject *self, PyObject *args) {
    Alloc a;
    int setup = settings_from(args, 1, 6, &a);
    if (setup < 0)
        return NULL;
    if (setup > 0)
        Py_RETURN_NONE;
    PyObject *ops_obj = PyTuple_GET_ITEM(args, 0);
    if (!PyList_Check(ops_obj)) {
        PyErr_SetString(PyExc_TypeError, "ops must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ops_obj);
    Block **blocks = calloc(n > 0 ? (size_t)n : 1, sizeof *blocks); /* by the position of their malloc */
    LiveMap unused = {NULL, NULL, NULL, 0, 0};
    if (blocks == NULL)
        return PyErr_NoMemory();
    u64 peak_r = 0, peak_a = 0, oom_alloc_size = 0;
    Py_ssize_t oom_at = -1;
    int unsupported = 0;
    for (Py_ssize_t position = 0; position < n && !unsupported; position++) {
        i64 op;
        if (!as_i64(PyList_GET_ITEM(ops_obj, position), &op)) {
            unsupported = 1;
        } else if (op >= 0) {
            u64 size = (u64)op >> SCHEDULE_STREAM_BITS;
            i64 stream = op & ((1 << SCHEDULE_STREAM_BITS) - 1);
            if (size >= SIZE_LIMIT) {
                unsupported = 1;
                break;
            }
            Block *b = alloc_malloc(&a, size, stream, &oom_alloc_size);
            if (a.nomem)
                goto nomem;
            if (a.unsupported) {
                unsupported = 1;
            } else if (b == NULL) {
                oom_at = position;
                break;
            } else {
                blocks[position] = b;
                if (a.allocated > peak_a)
                    peak_a = a.allocated;
                if (a.reserved > peak_r)
                    peak_r = a.reserved;
            }
        } else {
            i64 at = ~op;
            if (at >= position || blocks[at] == NULL) { /* not an earlier malloc, or freed already */
                unsupported = 1;
                break;
            }
            alloc_free(&a, blocks[at]);
            blocks[at] = NULL;
            if (a.nomem)
                goto nomem;
        }
    }
    free(blocks);
    u64 reserved = a.reserved, allocated = a.allocated;
    alloc_release(&a, &unused);
    if (unsupported)
        Py_RETURN_NONE;
    return Py_BuildValue("(KKKKn)", (unsigned long long)peak_r, (unsigned long long)peak_a,
                         (unsigned long long)reserved, (unsigned long long)allocated, oom_at);
nomem:
    free(blocks);
    alloc_release(&a, &unused);
    return PyErr_NoMemory();
}

/* ------------------------------------------------------------------------------------------ */
/* The trace's runs (memplan.doctor.replay.trace_shape) */

typedef struct {
    i64 *data; /* 4 values per event: (1, size, stream, 0) for an allocation, (0, runs back, offset, stream) */
    size_t n, cap;
} Run;

static int run_push(Run *r, i64 a, i64 b, i64 c, i64 d) {
    if (r->n + 4 > r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 4096;
        i64 *data = realloc(r->data, cap * sizeof(i64));
        if (data == NULL)
            return -1;
        r->data = data;
        r->cap = cap;
    }
    r->data[r->n++] = a;
    r->data[r->n++] = b;
    r->data[r->n++] = c;
    r->data[r->n++] = d;
    return 0;
}

static int run_same(const Run *previous, const Run *current, int have_previous) {
    return have_previous && previous->n == current->n
           && memcmp(previous->data, current->data, current->n * sizeof(i64)) == 0;
}

static PyObject *shape(PyObject *self, PyObject *args) {
    PyObject *events_obj, *kind_alloc;
    if (!PyArg_ParseTuple(args, "OO", &events_obj, &kind_alloc))
        return NULL;
    PyObject *events = PySequence_Fast(events_obj, "events must be a sequence");
    if (events == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(events);
    PyObject **items = PySequence_Fast_ITEMS(events);
    PyObject *starts = PyList_New(0), *same = PyList_New(0);
    LiveMap where = {NULL, NULL, NULL, 0, 0};
    Run runs[2] = {{NULL, 0, 0}, {NULL, 0, 0}};
    int cur = 0, have_previous = 0, unsupported = 0, failed = starts == NULL || same == NULL;
    i64 iteration = 0, run = -1;
    Py_ssize_t start = 0;
    for (Py_ssize_t position = 0; position < n && !failed && !unsupported; position++) {
        PyObject *event = items[position];
        i64 this_iteration, block_id, size, stream;
        if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) < 10 || !as_i64(PyTuple_GET_ITEM(event, 6), &this_iteration)
            || !as_i64(PyTuple_GET_ITEM(event, 2), &block_id) || !as_i64(PyTuple_GET_ITEM(event, 9), &stream)
            || n >= (1LL << 31)) {
            unsupported = 1;
            break;
        }
        if (run < 0 || this_iteration != iteration) {
            if (run >= 0) {
                if (PyList_Append(same, run_same(&runs[1 - cur], &runs[cur], have_previous) ? Py_True : Py_False) < 0) {
                    failed = 1;
                    break;
                }
                have_previous = 1;
                cur = 1 - cur;
            }
            runs[cur].n = 0;
            iteration = this_iteration;
            run++;
            start = position;
            PyObject *at = PyLong_FromSsize_t(position);
            if (at == NULL || PyList_Append(starts, at) < 0) {
                Py_XDECREF(at);
                failed = 1;
                break;
            }
            Py_DECREF(at);
        }
        int is_alloc = PyObject_RichCompareBool(PyTuple_GET_ITEM(event, 1), kind_alloc, Py_EQ);
        if (is_alloc < 0) {
            failed = 1;
            break;
        }
        i64 offset = position - start;
        if (is_alloc) {
            if (!as_i64(PyTuple_GET_ITEM(event, 3), &size)) {
                unsupported = 1;
                break;
            }
            if (live_set(&where, block_id, (run << 32) | offset) < 0 || run_push(&runs[cur], 1, size, stream, 0) < 0)
                failed = 1;
        } else {
            i64 found, alloc_run = -1, alloc_offset = -1;
            if (live_pop(&where, block_id, &found)) {
                alloc_run = found >> 32;
                alloc_offset = found & 0xFFFFFFFFLL;
            }
            if (run_push(&runs[cur], 0, run - alloc_run, alloc_offset, stream) < 0)
                failed = 1;
        }
    }
    if (!failed && !unsupported && run >= 0
        && PyList_Append(same, run_same(&runs[1 - cur], &runs[cur], have_previous) ? Py_True : Py_False) < 0)
        failed = 1;
    Py_DECREF(events);
    free(runs[0].data);
    free(runs[1].data);
    free(where.keys);
    free(where.values);
    free(where.used);
    if (failed || unsupported) {
        Py_XDECREF(starts);
        Py_XDECREF(same);
        if (failed && !PyErr_Occurred())
            PyErr_NoMemory();
        if (failed)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = Py_BuildValue("(NN)", PyList_AsTuple(starts), PyList_AsTuple(same));
    Py_DECREF(starts);
    Py_DECREF(same);
    return out;
}

/* ------------------------------------------------------------------------------------------ */
/* Copies of a recorded stretch of a schedule (memplan.alloc.schedule.repeat_copies) */

/* Whether every side's blocks have the sizes (ops) of ``sizes`` (-1: None); -1 on error. */
static int sides_match(PyObject *ops, PyObject *sides, PyObject *sizes) {
    Py_ssize_t n_ops = PyList_GET_SIZE(ops), n_sizes = PyTuple_GET_SIZE(sizes);
    for (Py_ssize_t c = 0; c < PyList_GET_SIZE(sides); c++) {
        PyObject *side = PySequence_Fast(PyList_GET_ITEM(sides, c), "a side must be a sequence");
        if (side == NULL)
            return -1;
        int ok = PySequence_Fast_GET_SIZE(side) == n_sizes;
        for (Py_ssize_t j = 0; ok && j < n_sizes; j++) {
            PyObject *b = PySequence_Fast_GET_ITEM(side, j);
            i64 want, at, have;
            if (!as_i64(PyTuple_GET_ITEM(sizes, j), &want))
                ok = 0;
            else if (b == Py_None)
                ok = want == -1;
            else
                ok = as_i64(b, &at) && at >= 0 && at < n_ops && as_i64(PyList_GET_ITEM(ops, at), &have) &&
                     have == want;
        }
        Py_DECREF(side);
        if (!ok)
            return 0;
    }
    return 1;
}

/* The copies' ops appended to ``ops``: the template's, its own frees moved by each copy's delta, the frees
 * of outside blocks (outside_at: flat (at, index) pairs) replaced by the side's block. 0: an op outside the
 * core's range (nothing appended), -1: error. */
static int append_copies(PyObject *ops, PyObject *tops, PyObject *outside_at, PyObject *sides, i64 base) {
    Py_ssize_t span = PyList_GET_SIZE(tops), k = PyList_GET_SIZE(sides), n_at = PyList_GET_SIZE(outside_at) / 2;
    Py_ssize_t start = PyList_GET_SIZE(ops);
    i64 *tv = malloc((span > 0 ? (size_t)span : 1) * sizeof *tv);
    i64 *outs = malloc((n_at > 0 ? (size_t)(2 * n_at) : 1) * sizeof *outs);
    if (tv == NULL || outs == NULL) {
        free(tv);
        free(outs);
        PyErr_NoMemory();
        return -1;
    }
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < span; i++)
        ok = as_i64(PyList_GET_ITEM(tops, i), &tv[i]);
    for (Py_ssize_t i = 0; ok && i < 2 * n_at; i++)
        ok = as_i64(PyList_GET_ITEM(outside_at, i), &outs[i]) && outs[i] >= 0 && (i % 2 ? 1 : outs[i] < span);
    for (Py_ssize_t c = 0; ok == 1 && c < k; c++) {
        i64 delta = base + (i64)c * span;
        PyObject *side = PySequence_Fast(PyList_GET_ITEM(sides, c), "a side must be a sequence");
        if (side == NULL) {
            ok = -1;
            break;
        }
        for (Py_ssize_t i = 0; ok == 1 && i < span; i++) {
            i64 op = tv[i] >= 0 ? tv[i] : tv[i] - delta;
            for (Py_ssize_t j = 0; j < n_at; j++) { /* a free of an outside block: the side's block */
                i64 block;
                if (outs[2 * j] == i) {
                    if (outs[2 * j + 1] >= PySequence_Fast_GET_SIZE(side) ||
                        !as_i64(PySequence_Fast_GET_ITEM(side, outs[2 * j + 1]), &block))
                        ok = 0;
                    op = ~block;
                }
            }
            PyObject *value = ok == 1 ? PyLong_FromLongLong(op) : NULL;
            if (ok == 1 && (value == NULL || PyList_Append(ops, value) < 0))
                ok = -1;
            Py_XDECREF(value);
        }
        Py_DECREF(side);
    }
    free(tv);
    free(outs);
    if (ok != 1 && PyList_SetSlice(ops, start, PyList_GET_SIZE(ops), NULL) < 0)
        return -1;
    return ok;
}

/* Each copy's blocks that outlive it: the template's result moved by the copy's delta. */
static PyObject *copied_results(PyObject *result, Py_ssize_t k, Py_ssize_t span, i64 base) {
    Py_ssize_t n = PyList_GET_SIZE(result);
    PyObject *out = PyList_New(k * n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t c = 0; c < k; c++) {
        i64 delta = base + (i64)c * span;
        for (Py_ssize_t r = 0; r < n; r++) {
            PyObject *blocks = PySequence_Fast(PyList_GET_ITEM(result, r), "a result must be a sequence");
            if (blocks == NULL)
                goto error;
            Py_ssize_t m = PySequence_Fast_GET_SIZE(blocks);
            PyObject *moved = PyList_New(m);
            if (moved == NULL) {
                Py_DECREF(blocks);
                goto error;
            }
            PyList_SET_ITEM(out, c * n + r, moved);
            for (Py_ssize_t i = 0; i < m; i++) {
                PyObject *b = PySequence_Fast_GET_ITEM(blocks, i);
                i64 at;
                PyObject *value;
                if (b == Py_None) {
                    Py_INCREF(Py_None);
                    value = Py_None;
                } else if (as_i64(b, &at)) {
                    value = PyLong_FromLongLong(at + delta);
                } else {
                    PyErr_SetString(PyExc_TypeError, "a block must be an int or None");
                    value = NULL;
                }
                if (value == NULL) {
                    Py_DECREF(blocks);
                    goto error;
                }
                PyList_SET_ITEM(moved, i, value);
            }
            Py_DECREF(blocks);
        }
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

/* repeat_copies(ops, template_ops, outside_at, sides, sizes, result, base): see memplan.alloc.schedule. */
static PyObject *repeat_copies(PyObject *self, PyObject *args) {
    PyObject *ops, *tops, *outside_at, *sides, *sizes, *result;
    long long base;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!L", &PyList_Type, &ops, &PyList_Type, &tops, &PyList_Type,
                          &outside_at, &PyList_Type, &sides, &PyTuple_Type, &sizes, &PyList_Type, &result, &base))
        return NULL;
    int match = sides_match(ops, sides, sizes);
    if (match <= 0) {
        if (match < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    int appended = append_copies(ops, tops, outside_at, sides, base);
    if (appended <= 0) {
        if (appended < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    return copied_results(result, PyList_GET_SIZE(sides), PyList_GET_SIZE(tops), base);
}

static PyMethodDef methods[] = {
    {"replay", replay, METH_VARARGS, "Replay a trace through the caching-allocator model (see the module comment)."},
    {"schedule", schedule, METH_VARARGS,
     "schedule(ops, max_split, divisions, gc_threshold, expandable, capacity) -> (peak_reserved, peak_allocated, "
     "reserved, allocated, oom_at) | None: memplan.alloc.schedule.replay_schedule."},
    {"repeat_copies", repeat_copies, METH_VARARGS,
     "repeat_copies(ops, template_ops, outside_at, sides, sizes, result, base) -> list | None: "
     "memplan.alloc.schedule.repeat_copies."},
    {"shape", shape, METH_VARARGS,
     "shape(events, alloc_kind) -> (run_starts, same_as_previous) | None: memplan.doctor.replay.trace_shape."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay_core",
                                    "C core of memplan.doctor.replay (CachingAllocator's rules).", -1, methods};

PyMODINIT_FUNC PyInit__replay_core(void) { return PyModule_Create(&module); }
