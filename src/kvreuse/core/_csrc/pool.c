/*
 * BlockPool's per-block loops of adoption and eviction (pool.py) on its own state, bound in a
 * BlockTable (table.c). Evicted keys go straight into the C ghost record (ghost.c); the events
 * and the counters stay with the caller. Each kernel's contract is the docstring of the pool
 * method it serves; the Python loop there is the reference it is tested against.
 */
#include "kvr.h"

PyObject *
kvr_ref_adopt(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    flat ref;
    PyObject *seq, *zero = NULL;
    kvr_table *t;
    Py_ssize_t i, n;
    if (check_args(nargs, 2, "ref_adopt") < 0 || (t = kvr_table_arg(args[0], "ref_adopt")) == NULL)
        return NULL;
    if ((seq = PySequence_Fast(args[1], "ref_adopt: blocks must be a sequence")) == NULL)
        return NULL;
    if (flat_open(t->ref, 4, "ref_adopt", &ref) < 0)
        goto out;
    if ((zero = PyList_New(0)) == NULL)
        goto close;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t b;
        if (block_id(item, ref.len, &b) < 0 ||
            (I32(ref)[b] == 0 && PyList_Append(zero, item) < 0)) {
            Py_CLEAR(zero);
            break;
        }
        I32(ref)[b] += 1;
    }
close:
    PyBuffer_Release(&ref.view);
out:
    Py_DECREF(seq);
    return zero;
}

/* Where evict_keys sends each evicted key: the C ghost record, and (when events are taken) a
 * list of (group, key, boundary) rows. */
typedef struct {
    PyObject *ghost, *gone; /* gone: NULL when no rows are wanted */
    Py_ssize_t num_keys;
} evicted;

static int
emit(evicted *out, int g, PyObject *key, PyObject *boundary)
{
    PyObject *row, *gid;
    out->num_keys++;
    if (kvr_ghost_add(out->ghost, g, key, boundary) < 0)
        return -1;
    if (out->gone == NULL)
        return 0;
    if ((gid = PyLong_FromLong(g)) == NULL)
        return -1;
    row = PyTuple_Pack(3, gid, key, boundary);
    Py_DECREF(gid);
    if (row == NULL || PyList_Append(out->gone, row) < 0) {
        Py_XDECREF(row);
        return -1;
    }
    Py_DECREF(row);
    return 0;
}

/* The lower keys of a large page (`more`'s list for block b, ascending) leave the index. */
static int
evict_lower(Py_ssize_t b, int g, PyObject *idx, PyObject *more, evicted *out)
{
    PyObject *bo = PyLong_FromSsize_t(b), *lower;
    Py_ssize_t j;
    int ret = -1;
    if (bo == NULL)
        return -1;
    lower = PyDict_GetItemWithError(more, bo);
    if (lower == NULL) {
        Py_DECREF(bo);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(lower);
    if (PyDict_DelItem(more, bo) < 0)
        goto out;
    for (j = 0; j < PyList_GET_SIZE(lower); j++) {
        PyObject *pair = PyList_GET_ITEM(lower, j); /* (boundary, key) */
        PyObject *k = PyTuple_GET_ITEM(pair, 1);
        if (PyDict_DelItem(idx, k) < 0 || emit(out, g, k, PyTuple_GET_ITEM(pair, 0)) < 0)
            goto out;
    }
    ret = 0;
out:
    Py_DECREF(lower);
    Py_DECREF(bo);
    return ret;
}

/* Evict one block's keys; 1 if it had any, 0 if not, -1 on error. */
static int
evict_block(Py_ssize_t b, PyObject *key1, flat *b1, flat *group, PyObject *index,
            PyObject *more, evicted *out)
{
    PyObject *key = PyList_GET_ITEM(key1, b), *idx, *bd;
    int g = I8(*group)[b], r;
    if (key == Py_None)
        return 0;
    if (g < 0 || g >= PyList_GET_SIZE(index)) {
        PyErr_Format(PyExc_IndexError, "evict: keyed block %zd has no group", b);
        return -1;
    }
    idx = PyList_GET_ITEM(index, g);
    if (PyDict_GET_SIZE(more) && evict_lower(b, g, idx, more, out) < 0)
        return -1;
    if (PyDict_DelItem(idx, key) < 0 || (bd = PyLong_FromLong(I32(*b1)[b])) == NULL)
        return -1;
    r = emit(out, g, key, bd);
    Py_DECREF(bd);
    if (r < 0)
        return -1;
    PyList_SET_ITEM(key1, b, Py_NewRef(Py_None)); /* drops the list's reference to the key */
    Py_DECREF(key);
    return 1;
}

/* evict_keys(table, blocks, group_id, ref_count, ghost, rows) -> (gone, num_keys, num_blocks)
 * BlockPool._evict_keys' loop: every key of `blocks` leaves its index (the lower keys of a
 * large page first) for the C ghost record `ghost` (trimmed once, at the end), in block order;
 * `gone` lists them as (group, key, boundary) rows when `rows` is true, else is None. Each block
 * then gets `group_id` and `ref_count`. The events stay with the caller. */
PyObject *
kvr_evict_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *key1, *index, *more, *ret = NULL;
    flat b1, group, ref;
    Py_ssize_t i, n, limit, num_blocks = 0;
    long group_id, ref_count;
    int rows;
    kvr_table *t;
    evicted out = {NULL, NULL, 0};
    if (check_args(nargs, 6, "evict_keys") < 0 || (t = kvr_table_arg(args[0], "evict_keys")) == NULL)
        return NULL;
    key1 = t->key1, index = t->index, more = t->more, out.ghost = args[4];
    if (!PyObject_TypeCheck(out.ghost, &kvr_GhostType)) {
        PyErr_SetString(PyExc_TypeError, "evict_keys: ghost must be a Ghost");
        return NULL;
    }
    group_id = PyLong_AsLong(args[2]);
    ref_count = PyLong_AsLong(args[3]);
    if (PyErr_Occurred() || (rows = PyObject_IsTrue(args[5])) < 0)
        return NULL;
    if (group_id < -128 || group_id > 127 || ref_count < INT32_MIN || ref_count > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "evict_keys: group_id or ref_count out of range");
        return NULL;
    }
    if ((seq = PySequence_Fast(args[1], "evict_keys: blocks must be iterable")) == NULL)
        return NULL;
    if (flat_open(t->b1, 4, "evict_keys", &b1) < 0)
        goto out;
    if (flat_open(t->group, 1, "evict_keys", &group) < 0)
        goto close_b1;
    if (flat_open(t->ref, 4, "evict_keys", &ref) < 0)
        goto close_group;
    limit = PyList_GET_SIZE(key1);
    if (b1.len < limit)
        limit = b1.len;
    if (group.len < limit)
        limit = group.len;
    if (ref.len < limit)
        limit = ref.len;
    if (rows && (out.gone = PyList_New(0)) == NULL)
        goto close;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n; i++) {
        Py_ssize_t b;
        int r;
        if (block_id(PySequence_Fast_GET_ITEM(seq, i), limit, &b) < 0 ||
            (r = evict_block(b, key1, &b1, &group, index, more, &out)) < 0)
            goto close;
        num_blocks += r;
        I32(ref)[b] = (int32_t)ref_count;
        I8(group)[b] = (int8_t)group_id;
    }
    ret = Py_BuildValue("(Onn)", rows ? out.gone : Py_None, out.num_keys, num_blocks);
close:
    kvr_ghost_trim(out.ghost); /* also after an error: the keys already added stay bounded */
    Py_XDECREF(out.gone);
    PyBuffer_Release(&ref.view);
close_group:
    PyBuffer_Release(&group.view);
close_b1:
    PyBuffer_Release(&b1.view);
out:
    Py_DECREF(seq);
    return ret;
}
