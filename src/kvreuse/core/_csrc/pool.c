/*
 * BlockPool's per-block loops (pool.py) on its own state: ref, b1 (array('i')), group
 * (array('b')), key1 (a list of bytes or None), the index (a list of dicts) and the lower keys of
 * large pages (a dict). The ghost record, the events and the counters stay with the caller.
 */
#include "kvr.h"

PyObject *
kvr_ref_adopt(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    flat ref;
    PyObject *seq, *zero = NULL;
    Py_ssize_t i, n;
    if (check_args(nargs, 2, "ref_adopt") < 0)
        return NULL;
    if ((seq = PySequence_Fast(args[1], "ref_adopt: blocks must be a sequence")) == NULL)
        return NULL;
    if (flat_open(args[0], 4, "ref_adopt", &ref) < 0)
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

typedef struct {
    int32_t b1, group, id;
} keyed_block;

static int
cmp_keyed(const void *pa, const void *pb)
{
    const keyed_block *a = pa, *b = pb;
    if (a->b1 != b->b1)
        return a->b1 > b->b1 ? -1 : 1; /* decreasing highest boundary */
    if (a->group != b->group)
        return a->group < b->group ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* Split the blocks that reached 0 into (unkeyed, keyed): unkeyed ones lose their group, keyed
 * ones are ordered for the tail (decreasing highest boundary, group, id). */
static PyObject *
split_release(PyObject *zero, PyObject *key1, flat *group, flat *b1, int multi)
{
    Py_ssize_t i, n = PyList_GET_SIZE(zero), nk = 0;
    keyed_block *kb = PyMem_Malloc(sizeof(keyed_block) * (size_t)(n ? n : 1));
    PyObject *unkeyed = PyList_New(0), *keyed = NULL, *ret = NULL;
    if (kb == NULL || unkeyed == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(zero, i);
        Py_ssize_t b = PyLong_AsSsize_t(item);
        if (PyList_GET_ITEM(key1, b) == Py_None) {
            I8(*group)[b] = -1;
            if (PyList_Append(unkeyed, item) < 0)
                goto out;
        }
        else {
            kb[nk].b1 = I32(*b1)[b];
            kb[nk].group = multi ? I8(*group)[b] : 0;
            kb[nk].id = (int32_t)b;
            nk++;
        }
    }
    qsort(kb, (size_t)nk, sizeof *kb, cmp_keyed);
    if ((keyed = PyList_New(nk)) == NULL)
        goto out;
    for (i = 0; i < nk; i++) {
        PyObject *v = PyLong_FromLong(kb[i].id);
        if (v == NULL)
            goto out;
        PyList_SET_ITEM(keyed, i, v);
    }
    ret = PyTuple_Pack(2, unkeyed, keyed);
out:
    PyMem_Free(kb);
    Py_XDECREF(unkeyed);
    Py_XDECREF(keyed);
    return ret;
}

/* ref_release(ref, ordered, key1, group, b1, multi_group) -> None | (unkeyed, keyed):
 * BlockPool.release's counting and the split of its queueing; None when no block reached 0. */
PyObject *
kvr_ref_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    flat ref, group, b1;
    PyObject *seq, *zero = NULL, *ret = NULL, *key1 = args[2];
    Py_ssize_t i, n, limit;
    int multi;
    if (check_args(nargs, 6, "ref_release") < 0)
        return NULL;
    if (!PyList_Check(key1)) {
        PyErr_SetString(PyExc_TypeError, "ref_release: key1 must be a list");
        return NULL;
    }
    if ((multi = PyObject_IsTrue(args[5])) < 0)
        return NULL;
    if ((seq = PySequence_Fast(args[1], "ref_release: ordered must be iterable")) == NULL)
        return NULL;
    if (flat_open(args[0], 4, "ref_release", &ref) < 0)
        goto out;
    if (flat_open(args[3], 1, "ref_release", &group) < 0)
        goto close_ref;
    if (flat_open(args[4], 4, "ref_release", &b1) < 0)
        goto close_group;
    limit = ref.len;
    if (group.len < limit)
        limit = group.len;
    if (b1.len < limit)
        limit = b1.len;
    if (PyList_GET_SIZE(key1) < limit)
        limit = PyList_GET_SIZE(key1);
    if ((zero = PyList_New(0)) == NULL)
        goto close;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t b;
        if (block_id(item, limit, &b) < 0)
            goto close;
        if (--I32(ref)[b] == 0 && PyList_Append(zero, item) < 0)
            goto close;
    }
    ret = PyList_GET_SIZE(zero) ? split_release(zero, key1, &group, &b1, multi)
                                : Py_NewRef(Py_None);
close:
    Py_XDECREF(zero);
    PyBuffer_Release(&b1.view);
close_group:
    PyBuffer_Release(&group.view);
close_ref:
    PyBuffer_Release(&ref.view);
out:
    Py_DECREF(seq);
    return ret;
}

/* Evict one block's keys into `gone`; 1 if it had any, 0 if not, -1 on error. */
static int
evict_block(Py_ssize_t b, PyObject *key1, flat *b1, flat *group, PyObject *index,
            PyObject *more, PyObject *gone)
{
    PyObject *key = PyList_GET_ITEM(key1, b), *idx, *gid, *row;
    int g = I8(*group)[b];
    if (key == Py_None)
        return 0;
    if (g < 0 || g >= PyList_GET_SIZE(index)) {
        PyErr_Format(PyExc_IndexError, "evict: keyed block %zd has no group", b);
        return -1;
    }
    idx = PyList_GET_ITEM(index, g);
    if ((gid = PyLong_FromLong(g)) == NULL)
        return -1;
    if (PyDict_GET_SIZE(more)) { /* the lower keys of a large page, ascending */
        PyObject *bo = PyLong_FromSsize_t(b), *lower;
        if (bo == NULL)
            goto fail;
        lower = PyDict_GetItemWithError(more, bo);
        if (lower != NULL) {
            Py_ssize_t j;
            Py_INCREF(lower);
            if (PyDict_DelItem(more, bo) < 0) {
                Py_DECREF(lower);
                Py_DECREF(bo);
                goto fail;
            }
            for (j = 0; j < PyList_GET_SIZE(lower); j++) {
                PyObject *pair = PyList_GET_ITEM(lower, j); /* (boundary, key) */
                PyObject *k = PyTuple_GET_ITEM(pair, 1);
                if (PyDict_DelItem(idx, k) < 0 ||
                    (row = PyTuple_Pack(3, gid, k, PyTuple_GET_ITEM(pair, 0))) == NULL) {
                    Py_DECREF(lower);
                    Py_DECREF(bo);
                    goto fail;
                }
                if (PyList_Append(gone, row) < 0) {
                    Py_DECREF(row);
                    Py_DECREF(lower);
                    Py_DECREF(bo);
                    goto fail;
                }
                Py_DECREF(row);
            }
            Py_DECREF(lower);
        }
        Py_DECREF(bo);
        if (PyErr_Occurred())
            goto fail;
    }
    if (PyDict_DelItem(idx, key) < 0)
        goto fail;
    {
        PyObject *bd = PyLong_FromLong(I32(*b1)[b]);
        if (bd == NULL)
            goto fail;
        row = PyTuple_Pack(3, gid, key, bd);
        Py_DECREF(bd);
    }
    if (row == NULL || PyList_Append(gone, row) < 0) {
        Py_XDECREF(row);
        goto fail;
    }
    Py_DECREF(row);
    Py_DECREF(gid);
    Py_INCREF(Py_None);
    PyList_SET_ITEM(key1, b, Py_None); /* drops the list's reference to the key */
    Py_DECREF(key);
    return 1;
fail:
    Py_DECREF(gid);
    return -1;
}

/* evict_keys(blocks, key1, b1, group, ref, index, more, group_id, ref_count)
 *     -> (gone, num_blocks)
 * BlockPool._evict_keys' loop: every key of `blocks` leaves its index (the lower keys of a
 * large page first), as (group, key, boundary) rows in block order; each block then gets
 * `group_id` and `ref_count`. The ghost record and the events stay with the caller. */
PyObject *
kvr_evict_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *key1 = args[1], *index = args[5], *more = args[6], *gone = NULL, *ret = NULL;
    flat b1, group, ref;
    Py_ssize_t i, n, limit, num_blocks = 0;
    long group_id, ref_count;
    if (check_args(nargs, 9, "evict_keys") < 0)
        return NULL;
    if (!PyList_Check(key1) || !PyList_Check(index) || !PyDict_Check(more)) {
        PyErr_SetString(PyExc_TypeError, "evict_keys: key1 and index must be lists, more a dict");
        return NULL;
    }
    group_id = PyLong_AsLong(args[7]);
    ref_count = PyLong_AsLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (group_id < -128 || group_id > 127 || ref_count < INT32_MIN || ref_count > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "evict_keys: group_id or ref_count out of range");
        return NULL;
    }
    if ((seq = PySequence_Fast(args[0], "evict_keys: blocks must be iterable")) == NULL)
        return NULL;
    if (flat_open(args[2], 4, "evict_keys", &b1) < 0)
        goto out;
    if (flat_open(args[3], 1, "evict_keys", &group) < 0)
        goto close_b1;
    if (flat_open(args[4], 4, "evict_keys", &ref) < 0)
        goto close_group;
    limit = PyList_GET_SIZE(key1);
    if (b1.len < limit)
        limit = b1.len;
    if (group.len < limit)
        limit = group.len;
    if (ref.len < limit)
        limit = ref.len;
    if ((gone = PyList_New(0)) == NULL)
        goto close;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n; i++) {
        Py_ssize_t b;
        int r;
        if (block_id(PySequence_Fast_GET_ITEM(seq, i), limit, &b) < 0 ||
            (r = evict_block(b, key1, &b1, &group, index, more, gone)) < 0)
            goto close;
        num_blocks += r;
        I32(ref)[b] = (int32_t)ref_count;
        I8(group)[b] = (int8_t)group_id;
    }
    ret = Py_BuildValue("(On)", gone, num_blocks);
close:
    Py_XDECREF(gone);
    PyBuffer_Release(&ref.view);
close_group:
    PyBuffer_Release(&group.view);
close_b1:
    PyBuffer_Release(&b1.view);
out:
    Py_DECREF(seq);
    return ret;
}

/* key_pages(key1, b1, group, blocks, keys, boundaries, group_id): BlockPool._publish_pages'
 * loop, each block taking its single key, boundary and group (the index is the caller's). */
PyObject *
kvr_key_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *key1 = args[0], *blocks = NULL, *keys = NULL, *bounds = NULL, *ret = NULL;
    flat b1, group;
    Py_ssize_t i, n, limit;
    long group_id;
    if (check_args(nargs, 7, "key_pages") < 0)
        return NULL;
    if (!PyList_Check(key1)) {
        PyErr_SetString(PyExc_TypeError, "key_pages: key1 must be a list");
        return NULL;
    }
    group_id = PyLong_AsLong(args[6]);
    if (group_id == -1 && PyErr_Occurred())
        return NULL;
    if (group_id < 0 || group_id > 127) {
        PyErr_SetString(PyExc_OverflowError, "key_pages: group_id out of range");
        return NULL;
    }
    blocks = PySequence_Fast(args[3], "key_pages: blocks must be a sequence");
    keys = blocks ? PySequence_Fast(args[4], "key_pages: keys must be a sequence") : NULL;
    bounds = keys ? PySequence_Fast(args[5], "key_pages: boundaries must be a sequence") : NULL;
    if (bounds == NULL)
        goto out;
    n = PySequence_Fast_GET_SIZE(blocks);
    if (PySequence_Fast_GET_SIZE(keys) != n || PySequence_Fast_GET_SIZE(bounds) != n) {
        PyErr_SetString(PyExc_ValueError, "key_pages: blocks, keys and boundaries differ in length");
        goto out;
    }
    if (flat_open(args[1], 4, "key_pages", &b1) < 0)
        goto out;
    if (flat_open(args[2], 1, "key_pages", &group) < 0)
        goto close_b1;
    limit = PyList_GET_SIZE(key1);
    if (b1.len < limit)
        limit = b1.len;
    if (group.len < limit)
        limit = group.len;
    for (i = 0; i < n; i++) {
        Py_ssize_t b;
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        long bd = PyLong_AsLong(PySequence_Fast_GET_ITEM(bounds, i));
        if ((bd == -1 && PyErr_Occurred()) ||
            block_id(PySequence_Fast_GET_ITEM(blocks, i), limit, &b) < 0)
            goto close;
        if (bd < INT32_MIN || bd > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "key_pages: boundary out of range");
            goto close;
        }
        Py_INCREF(key);
        PyList_SetItem(key1, b, key);
        I32(b1)[b] = (int32_t)bd;
        I8(group)[b] = (int8_t)group_id;
    }
    ret = Py_NewRef(Py_None);
close:
    PyBuffer_Release(&group.view);
close_b1:
    PyBuffer_Release(&b1.view);
out:
    Py_XDECREF(blocks);
    Py_XDECREF(keys);
    Py_XDECREF(bounds);
    return ret;
}
