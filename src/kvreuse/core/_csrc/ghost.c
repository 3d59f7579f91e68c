/*
 * The ghost record (ghost.py's GhostRecord) in C, without a Python object per remembered key:
 * its state and operations here, its Python type (the same interface and observable behaviour)
 * in ghost_type.c, and kvr_ghost_add / kvr_ghost_trim for the eviction kernel (pool.c).
 *
 * Keys live in one FIFO ring in insertion order over all groups (so the oldest key overall is
 * simply the ring's head) and in an open-addressing table (linear probing, no tombstones) that
 * maps (group, key) to the key's ring slot. A discarded key leaves the table at once and leaves
 * a dead slot (key NULL) in the ring, skipped when the trim reaches it. When the ring fills it is
 * compacted (dead slots at least half of it) or doubled, and the table rebuilt.
 * Keys must be bytes: their hash is cached in the object, so probing costs no hashing.
 */
#include "ghost.h"

#define EMPTY UINT64_MAX
#define TAG(e) ((uint32_t)((e) >> 32))
#define IDX(e) ((size_t)((e)&0xFFFFFFFFu))
#define ENTRY(tag, idx) ((uint64_t)(tag) << 32 | (uint64_t)(idx))
#define MAX_RING ((size_t)1 << 31)

static uint32_t
mix(Py_hash_t hash, int gid)
{
    uint64_t h = (uint64_t)hash ^ ((uint64_t)gid * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ULL;
    return (uint32_t)(h ^ (h >> 32));
}

static int
same_key(const ghost_slot *s, int gid, PyObject *key, Py_hash_t hash)
{
    if (s->gid != gid || s->hash != hash)
        return 0;
    if (s->key == key)
        return 1;
    return PyBytes_GET_SIZE(s->key) == PyBytes_GET_SIZE(key) &&
           memcmp(PyBytes_AS_STRING(s->key), PyBytes_AS_STRING(key),
                  (size_t)PyBytes_GET_SIZE(key)) == 0;
}

/* The table index holding (gid, key), or the empty index where it would go (*found = 0). */
static size_t
probe(const Ghost *g, int gid, PyObject *key, Py_hash_t hash, uint32_t tag, int *found)
{
    size_t i = tag & g->table_mask;
    ghost_entry e;
    while ((e = g->table[i]) != EMPTY) {
        if (TAG(e) == tag && same_key(&g->ring[IDX(e)], gid, key, hash)) {
            *found = 1;
            return i;
        }
        i = (i + 1) & g->table_mask;
    }
    *found = 0;
    return i;
}

/* Empty table index i, shifting later entries of its run back (linear probing's deletion). */
static void
table_delete(Ghost *g, size_t i)
{
    size_t j = i, mask = g->table_mask;
    for (;;) {
        size_t k;
        j = (j + 1) & mask;
        if (g->table[j] == EMPTY)
            break;
        k = TAG(g->table[j]) & mask;
        /* the entry at j may move to i when its home is not cyclically in (i, j] */
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
            continue;
        g->table[i] = g->table[j];
        i = j;
    }
    g->table[i] = EMPTY;
}

/* (Re)build the table for the live slots, with at least 2 * want + 2 entries. */
int
ghost_table_rebuild(Ghost *g, Py_ssize_t want)
{
    size_t n = 16, i;
    long long pos;
    ghost_entry *t;
    while (n < (size_t)want * 2 + 2)
        n <<= 1;
    if ((t = PyMem_Malloc(n * sizeof *t)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < n; i++)
        t[i] = EMPTY;
    PyMem_Free(g->table);
    g->table = t;
    g->table_mask = n - 1;
    for (pos = g->head; pos < g->tail; pos++) {
        const ghost_slot *s = &SLOT(g, pos);
        if (s->key != NULL) {
            i = s->tag & g->table_mask;
            while (t[i] != EMPTY)
                i = (i + 1) & g->table_mask;
            t[i] = ENTRY(s->tag, (size_t)pos & g->ring_mask);
        }
    }
    return 0;
}

/* Room for one more slot at the tail: compact the ring when dead slots are half of it, else
 * double it; either way the slots move, so the table is rebuilt (amortized O(1) per add). */
static int
ring_reserve(Ghost *g)
{
    size_t cap = g->ring_mask + 1, used = (size_t)(g->tail - g->head);
    ghost_slot *r;
    long long pos, to = 0;
    if (g->ring != NULL && used < cap)
        return 0;
    if (g->ring == NULL || used - (size_t)g->size < cap / 2) {
        if (g->ring != NULL && cap >= MAX_RING) {
            PyErr_SetString(PyExc_MemoryError, "ghost: more than 2**31 slots");
            return -1;
        }
        cap = g->ring == NULL ? 16 : cap * 2;
    }
    if ((r = PyMem_Malloc(cap * sizeof *r)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (pos = g->head; pos < g->tail; pos++)
        if (SLOT(g, pos).key != NULL)
            r[to++] = SLOT(g, pos);
    PyMem_Free(g->ring);
    g->ring = r;
    g->ring_mask = cap - 1;
    g->head = 0;
    g->tail = to;
    return ghost_table_rebuild(g, g->size);
}

/* A group id as a list index (negative counts from the end, as GhostRecord's list does). */
int
ghost_group_of(Ghost *g, PyObject *o, int *out)
{
    Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_IndexError);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0)
        v += g->num_groups;
    if (v < 0 || v >= g->num_groups) {
        PyErr_Format(PyExc_IndexError, "ghost: group id out of range [0, %zd)", g->num_groups);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The hash of a key (an unhashable one raises, as a dict lookup does); only bytes keys can be
 * in the record. */
static int
key_hash(PyObject *key, Py_hash_t *hash, int *is_bytes)
{
    *is_bytes = PyBytes_Check(key);
    *hash = PyObject_Hash(key);
    return *hash == -1 && PyErr_Occurred() ? -1 : 0;
}

void
ghost_trim(Ghost *g)
{
    while (g->size > g->capacity) {
        size_t idx = (size_t)g->head & g->ring_mask, i;
        ghost_slot *s = &g->ring[idx];
        g->head++;
        if (s->key == NULL)
            continue;
        i = s->tag & g->table_mask; /* the live slot's own entry: no key comparison */
        while (g->table[i] != ENTRY(s->tag, idx))
            i = (i + 1) & g->table_mask;
        table_delete(g, i);
        Py_CLEAR(s->key);
        g->size--;
    }
    if (g->size == 0) /* nothing live: forget the dead slots too */
        g->head = g->tail;
}

/* Remember one key as the newest; a key already there moves to the newest place. */
int
ghost_add_one(Ghost *g, int gid, PyObject *key, long long boundary)
{
    Py_hash_t hash;
    uint32_t tag;
    int found;
    size_t i;
    ghost_slot *s;
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "ghost: keys must be bytes, not %.100s",
                     Py_TYPE(key)->tp_name);
        return -1;
    }
    if ((hash = PyObject_Hash(key)) == -1)
        return -1;
    if (ring_reserve(g) < 0)
        return -1;
    if ((size_t)(g->size + 1) * 2 > g->table_mask && ghost_table_rebuild(g, g->size + 1) < 0)
        return -1;
    tag = mix(hash, gid);
    i = probe(g, gid, key, hash, tag, &found);
    if (found) {
        Py_CLEAR(g->ring[IDX(g->table[i])].key);
        g->size--;
    }
    s = &SLOT(g, g->tail);
    s->key = Py_NewRef(key);
    s->hash = hash;
    s->boundary = boundary;
    s->gid = gid;
    s->tag = tag;
    g->table[i] = ENTRY(tag, (size_t)g->tail & g->ring_mask);
    g->tail++;
    g->size++;
    return 0;
}

/* Forget (gid, key) if present. */
int
ghost_discard_one(Ghost *g, int gid, PyObject *key)
{
    Py_hash_t hash;
    int is_bytes, found;
    size_t i;
    if (key_hash(key, &hash, &is_bytes) < 0)
        return -1;
    if (!is_bytes || g->size == 0)
        return 0;
    i = probe(g, gid, key, hash, mix(hash, gid), &found);
    if (found) {
        Py_CLEAR(g->ring[IDX(g->table[i])].key);
        table_delete(g, i);
        g->size--;
        if (g->size == 0)
            g->head = g->tail;
    }
    return 0;
}

int
ghost_has(Ghost *g, int gid, PyObject *key)
{
    Py_hash_t hash;
    int is_bytes, found = 0;
    if (key_hash(key, &hash, &is_bytes) < 0)
        return -1;
    if (is_bytes && g->size)
        probe(g, gid, key, hash, mix(hash, gid), &found);
    return found;
}

void
ghost_drop_all(Ghost *g)
{
    long long pos;
    if (g->ring != NULL)
        for (pos = g->head; pos < g->tail; pos++)
            Py_CLEAR(SLOT(g, pos).key);
    PyMem_Free(g->ring);
    PyMem_Free(g->table);
    g->ring = NULL;
    g->table = NULL;
    g->ring_mask = 0;
    g->head = g->tail = 0;
    g->size = 0;
}

/* For evict_keys (pool.c): remember one evicted key of group `gid` (the pool's own, checked
 * here too); the caller trims once with kvr_ghost_trim after its batch. */
int
kvr_ghost_add(PyObject *ghost, int gid, PyObject *key, PyObject *boundary)
{
    Ghost *g = (Ghost *)ghost;
    long long bd;
    if (g->capacity == 0)
        return 0;
    if (gid < 0 || gid >= g->num_groups) {
        PyErr_Format(PyExc_IndexError, "ghost: group id out of range [0, %zd)", g->num_groups);
        return -1;
    }
    bd = PyLong_AsLongLong(boundary);
    if (bd == -1 && PyErr_Occurred())
        return -1;
    return ghost_add_one(g, gid, key, bd);
}

void
kvr_ghost_trim(PyObject *ghost)
{
    ghost_trim((Ghost *)ghost);
}

