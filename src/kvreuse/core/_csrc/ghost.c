/*
 * The ghost record (ghost.py's GhostRecord) as a C type: the same interface and observable
 * behaviour, without a Python object per remembered key.
 *
 * Keys live in one FIFO ring in insertion order over all groups (so the oldest key overall is
 * simply the ring's head) and in an open-addressing table (linear probing, no tombstones) that
 * maps (group, key) to the key's ring slot. A discarded key leaves the table at once and leaves
 * a dead slot (key NULL) in the ring, skipped when the trim reaches it. When the ring fills it is
 * compacted (dead slots at least half of it) or doubled, and the table rebuilt.
 * Keys must be bytes: their hash is cached in the object, so probing costs no hashing.
 */
#include "kvr.h"

typedef struct {
    PyObject *key; /* owned; NULL: a dead slot */
    Py_hash_t hash;
    long long boundary;
    int gid;
    uint32_t tag; /* mix(hash, gid): the key's home in the table and its quick filter */
} ghost_slot;

/* A table entry: the slot's tag (high 32 bits) and its index in the ring, so probing and the
 * deletion's shifting read no ring slot but the one that matches. */
typedef uint64_t ghost_entry;
#define EMPTY UINT64_MAX
#define TAG(e) ((uint32_t)((e) >> 32))
#define IDX(e) ((size_t)((e)&0xFFFFFFFFu))
#define ENTRY(tag, idx) ((uint64_t)(tag) << 32 | (uint64_t)(idx))
#define MAX_RING ((size_t)1 << 31)

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_groups, capacity, size;
    ghost_slot *ring;
    size_t ring_mask;
    long long head, tail; /* absolute positions: the slots head..tail-1 are in use */
    ghost_entry *table;
    size_t table_mask;
} Ghost;

#define SLOT(g, pos) ((g)->ring[(size_t)(pos) & (g)->ring_mask])

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
static int
table_rebuild(Ghost *g, Py_ssize_t want)
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
    return table_rebuild(g, g->size);
}

/* A group id as a list index (negative counts from the end, as GhostRecord's list does). */
static int
group_of(Ghost *g, PyObject *o, int *out)
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

static void
trim(Ghost *g)
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
static int
add_one(Ghost *g, int gid, PyObject *key, long long boundary)
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
    if ((size_t)(g->size + 1) * 2 > g->table_mask && table_rebuild(g, g->size + 1) < 0)
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
static int
discard_one(Ghost *g, int gid, PyObject *key)
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

static int
has(Ghost *g, int gid, PyObject *key)
{
    Py_hash_t hash;
    int is_bytes, found = 0;
    if (key_hash(key, &hash, &is_bytes) < 0)
        return -1;
    if (is_bytes && g->size)
        probe(g, gid, key, hash, mix(hash, gid), &found);
    return found;
}

static void
drop_all(Ghost *g)
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
    return add_one(g, gid, key, bd);
}

void
kvr_ghost_trim(PyObject *ghost)
{
    trim((Ghost *)ghost);
}

/* ------------------------------------------------------------------ the Python interface */

static int
Ghost_init(Ghost *g, PyObject *args, PyObject *kwds)
{
    Py_ssize_t num_groups, capacity;
    static char *names[] = {"num_groups", "capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn", names, &num_groups, &capacity))
        return -1;
    if (num_groups < 1 || num_groups > 127 || capacity < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "Ghost: num_groups must be in [1, 127] and capacity >= 0");
        return -1;
    }
    drop_all(g);
    g->num_groups = num_groups;
    g->capacity = capacity;
    return table_rebuild(g, 0);
}

static void
Ghost_dealloc(Ghost *g)
{
    drop_all(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *
Ghost_add_many(Ghost *g, PyObject *evicted)
{
    PyObject *seq;
    Py_ssize_t i, n;
    int err = 0;
    if (g->capacity == 0)
        Py_RETURN_NONE;
    if ((seq = PySequence_Fast(evicted, "ghost: add_many takes an iterable of triples")) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n && !err; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, i);
        int gid;
        long long boundary;
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 3) {
            PyErr_SetString(PyExc_TypeError, "ghost: add_many rows are (group_id, key, boundary)");
            err = 1;
            break;
        }
        boundary = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 2));
        err = (boundary == -1 && PyErr_Occurred()) ||
              group_of(g, PyTuple_GET_ITEM(row, 0), &gid) < 0 ||
              add_one(g, gid, PyTuple_GET_ITEM(row, 1), boundary) < 0;
    }
    Py_DECREF(seq);
    trim(g); /* the rows added before an error are kept, within capacity */
    if (err)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Ghost_add(Ghost *g, PyObject *const *args, Py_ssize_t nargs)
{
    int gid;
    long long boundary;
    if (check_args(nargs, 3, "add") < 0)
        return NULL;
    if (g->capacity == 0)
        Py_RETURN_NONE;
    boundary = PyLong_AsLongLong(args[2]);
    if ((boundary == -1 && PyErr_Occurred()) || group_of(g, args[0], &gid) < 0 ||
        add_one(g, gid, args[1], boundary) < 0)
        return NULL;
    trim(g);
    Py_RETURN_NONE;
}

static PyObject *
Ghost_discard(Ghost *g, PyObject *const *args, Py_ssize_t nargs)
{
    int gid;
    if (check_args(nargs, 2, "discard") < 0 || group_of(g, args[0], &gid) < 0 ||
        discard_one(g, gid, args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Ghost_discard_many(Ghost *g, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq;
    Py_ssize_t i, n;
    int gid;
    if (check_args(nargs, 2, "discard_many") < 0 || group_of(g, args[0], &gid) < 0)
        return NULL;
    if (g->size == 0)
        Py_RETURN_NONE;
    if ((seq = PySequence_Fast(args[1], "ghost: discard_many takes a sequence of keys")) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n && g->size; i++) {
        if (discard_one(g, gid, PySequence_Fast_GET_ITEM(seq, i)) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Ghost_contains_method(Ghost *g, PyObject *const *args, Py_ssize_t nargs)
{
    int gid, r;
    if (check_args(nargs, 2, "contains") < 0 || group_of(g, args[0], &gid) < 0 ||
        (r = has(g, gid, args[1])) < 0)
        return NULL;
    return PyBool_FromLong(r);
}

/* `(group_id, key) in ghost`: anything but a pair is not in it. */
static int
Ghost_sq_contains(Ghost *g, PyObject *item)
{
    int gid;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2)
        return 0;
    if (group_of(g, PyTuple_GET_ITEM(item, 0), &gid) < 0)
        return -1;
    return has(g, gid, PyTuple_GET_ITEM(item, 1));
}

static Py_ssize_t
Ghost_len(Ghost *g)
{
    return g->size;
}

static PyObject *
Ghost_clear(Ghost *g, PyObject *unused)
{
    drop_all(g);
    if (table_rebuild(g, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The live slots oldest first, as (gid, boundary, key) rows (with_boundary) or (gid, key). */
static PyObject *
rows(Ghost *g, int with_boundary)
{
    PyObject *out = PyList_New(g->size);
    Py_ssize_t n = 0;
    long long pos;
    if (out == NULL)
        return NULL;
    for (pos = g->head; pos < g->tail && n < g->size; pos++) {
        const ghost_slot *s = &SLOT(g, pos);
        PyObject *row;
        if (s->key == NULL)
            continue;
        row = with_boundary ? Py_BuildValue("(iLO)", s->gid, s->boundary, s->key)
                            : Py_BuildValue("(iO)", s->gid, s->key);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, row);
    }
    return out;
}

static PyObject *
Ghost_entries(Ghost *g, PyObject *unused)
{
    return rows(g, 1);
}

static PyObject *
Ghost_iter(Ghost *g)
{
    PyObject *list = rows(g, 0), *it;
    if (list == NULL)
        return NULL;
    it = PyObject_GetIter(list);
    Py_DECREF(list);
    return it;
}

/* Pickling and copy.deepcopy: the constructor's arguments and the rows, oldest first. */
static PyObject *
Ghost_reduce(Ghost *g, PyObject *unused)
{
    PyObject *state = PyList_New(g->size), *ret;
    Py_ssize_t n = 0;
    long long pos;
    if (state == NULL)
        return NULL;
    for (pos = g->head; pos < g->tail && n < g->size; pos++) {
        const ghost_slot *s = &SLOT(g, pos);
        PyObject *row;
        if (s->key == NULL)
            continue;
        if ((row = Py_BuildValue("(iOL)", s->gid, s->key, s->boundary)) == NULL) {
            Py_DECREF(state);
            return NULL;
        }
        PyList_SET_ITEM(state, n++, row);
    }
    ret = Py_BuildValue("(O(nn)O)", Py_TYPE(g), g->num_groups, g->capacity, state);
    Py_DECREF(state);
    return ret;
}

static PyObject *
Ghost_setstate(Ghost *g, PyObject *state)
{
    PyObject *r;
    drop_all(g);
    if (table_rebuild(g, 0) < 0)
        return NULL;
    if ((r = Ghost_add_many(g, state)) == NULL)
        return NULL;
    return r;
}

static PyObject *
Ghost_capacity(Ghost *g, void *unused)
{
    return PyLong_FromSsize_t(g->capacity);
}

#define FAST(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef Ghost_methods[] = {
    {"add", FAST(Ghost_add), METH_FASTCALL, "add(group_id, key, boundary)"},
    {"add_many", (PyCFunction)Ghost_add_many, METH_O,
     "add_many(rows): remember (group_id, key, boundary) rows, oldest first; trim once"},
    {"discard", FAST(Ghost_discard), METH_FASTCALL, "discard(group_id, key)"},
    {"discard_many", FAST(Ghost_discard_many), METH_FASTCALL, "discard_many(group_id, keys)"},
    {"contains", FAST(Ghost_contains_method), METH_FASTCALL, "contains(group_id, key) -> bool"},
    {"clear", (PyCFunction)Ghost_clear, METH_NOARGS, "clear()"},
    {"entries", (PyCFunction)Ghost_entries, METH_NOARGS,
     "entries() -> [(group_id, boundary, key)], oldest first"},
    {"__reduce__", (PyCFunction)Ghost_reduce, METH_NOARGS, NULL},
    {"__setstate__", (PyCFunction)Ghost_setstate, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ghost_getset[] = {
    {"capacity", (getter)Ghost_capacity, NULL, "the most keys the record holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Ghost_as_sequence = {
    .sq_length = (lenfunc)Ghost_len,
    .sq_contains = (objobjproc)Ghost_sq_contains,
};

PyTypeObject kvr_GhostType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvreuse.core._native.Ghost",
    .tp_basicsize = sizeof(Ghost),
    .tp_dealloc = (destructor)Ghost_dealloc,
    .tp_as_sequence = &Ghost_as_sequence,
    .tp_iter = (getiterfunc)Ghost_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ghost(num_groups, capacity): GhostRecord's interface and behaviour (ghost.py)",
    .tp_methods = Ghost_methods,
    .tp_getset = Ghost_getset,
    .tp_init = (initproc)Ghost_init,
    .tp_new = PyType_GenericNew,
};
