/*
 * BlockPool's loops of publication and release (pool.py) on its own state, bound in a
 * BlockTable (table.c): the contract of each is the docstring of the pool method it serves
 * (`_publish_each`, `_release_each`), whose Python loop is the reference it is tested against.
 * The ghost record, the counters, the events and the policy stay with the caller.
 */
#include "kvr.h"

PyObject *kvr_publish_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The list of lower keys of block `blk` in `more`, made empty if it has none (borrowed). */
static PyObject *
lower_keys(PyObject *more, PyObject *blk)
{
    PyObject *lower = PyDict_GetItemWithError(more, blk);
    if (lower != NULL || PyErr_Occurred())
        return lower;
    if ((lower = PyList_New(0)) == NULL)
        return NULL;
    if (PyDict_SetItem(more, blk, lower) < 0) {
        Py_DECREF(lower);
        return NULL;
    }
    Py_DECREF(lower); /* the dict holds it */
    return lower;
}

/* Add (bd, key) to block `blk`'s lower keys (ascending): `_attach`. `sort`: the key is below
 * the block's highest and is sorted in; else it is the old highest key, moved down, and the
 * largest of them (publication is ascending). */
static int
add_lower(PyObject *more, PyObject *blk, PyObject *bd, PyObject *key, int sort)
{
    PyObject *lower = lower_keys(more, blk), *pair;
    int rc;
    if (lower == NULL || (pair = PyTuple_Pack(2, bd, key)) == NULL)
        return -1;
    rc = PyList_Append(lower, pair);
    Py_DECREF(pair);
    return rc < 0 ? -1 : sort ? PyList_Sort(lower) : 0;
}

typedef struct {
    PyObject *idx, *key1, *more, *blocks, *keys, *bounds, *done, *fresh;
    flat b1, group;
    Py_ssize_t limit;
    int8_t group_id;
} publication;

/* One entry: 1 published, 0 skipped (NULL block or key present), -1 error. */
static int
publish_one(publication *p, Py_ssize_t i)
{
    PyObject *item = PySequence_Fast_GET_ITEM(p->blocks, i);
    PyObject *key = PySequence_Fast_GET_ITEM(p->keys, i);
    PyObject *bd_obj = PySequence_Fast_GET_ITEM(p->bounds, i), *old, *got;
    Py_ssize_t b, size;
    long bd;
    if (block_id(item, p->limit, &b) < 0)
        return -1;
    if (b == 0)
        return 0;
    bd = PyLong_AsLong(bd_obj);
    if (bd == -1 && PyErr_Occurred())
        return -1;
    if (bd < INT32_MIN || bd > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "publish_keys: boundary out of range");
        return -1;
    }
    old = PyList_GET_ITEM(p->key1, b);
    size = PyDict_GET_SIZE(p->idx);
    if ((got = PyDict_SetDefault(p->idx, key, item)) == NULL)
        return -1;
    if (PyDict_GET_SIZE(p->idx) == size)
        return 0; /* the first publisher keeps the key */
    if (old != Py_None && bd <= I32(p->b1)[b]) { /* below the block's highest key */
        if (add_lower(p->more, item, bd_obj, key, 1) < 0)
            return -1;
    }
    else {
        if (old != Py_None) { /* the old highest key joins the lower ones */
            PyObject *old_bd = PyLong_FromLong(I32(p->b1)[b]);
            int rc = old_bd == NULL ? -1 : add_lower(p->more, item, old_bd, old, 0);
            Py_XDECREF(old_bd);
            if (rc < 0)
                return -1;
        }
        Py_INCREF(key);
        PyList_SetItem(p->key1, b, key); /* releases the old inline key, kept in `more` if any */
        I32(p->b1)[b] = (int32_t)bd;
    }
    I8(p->group)[b] = p->group_id;
    if (PyList_Append(p->done, bd_obj) < 0 || PyList_Append(p->fresh, key) < 0)
        return -1;
    return 1;
}

/* publish_keys(table, group_id, blocks, keys, boundaries) -> (done, fresh):
 * `_publish_each`: `done` are the boundaries published and `fresh` their keys, in entry order.
 * The ghost and the counters are the caller's. */
PyObject *
kvr_publish_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    publication p = {0};
    PyObject *ret = NULL;
    kvr_table *t;
    Py_ssize_t i, n;
    long gid;
    if (check_args(nargs, 5, "publish_keys") < 0 ||
        (t = kvr_table_arg(args[0], "publish_keys")) == NULL)
        return NULL;
    gid = PyLong_AsLong(args[1]);
    if (gid == -1 && PyErr_Occurred())
        return NULL;
    if (gid < 0 || gid > 127 || gid >= PyList_GET_SIZE(t->index)) {
        PyErr_SetString(PyExc_OverflowError, "publish_keys: group_id out of range");
        return NULL;
    }
    p.idx = PyList_GET_ITEM(t->index, gid);
    p.key1 = t->key1;
    p.more = t->more;
    if (!PyDict_Check(p.idx)) {
        PyErr_SetString(PyExc_TypeError, "publish_keys: the group's index must be a dict");
        return NULL;
    }
    p.group_id = (int8_t)gid;
    p.blocks = PySequence_Fast(args[2], "publish_keys: blocks must be a sequence");
    p.keys = p.blocks ? PySequence_Fast(args[3], "publish_keys: keys must be a sequence") : NULL;
    p.bounds = p.keys ? PySequence_Fast(args[4], "publish_keys: boundaries must be a sequence")
                      : NULL;
    if (p.bounds == NULL)
        goto out;
    n = PySequence_Fast_GET_SIZE(p.blocks);
    if (PySequence_Fast_GET_SIZE(p.keys) != n || PySequence_Fast_GET_SIZE(p.bounds) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "publish_keys: blocks, keys and boundaries differ in length");
        goto out;
    }
    if (flat_open(t->b1, 4, "publish_keys", &p.b1) < 0)
        goto out;
    if (flat_open(t->group, 1, "publish_keys", &p.group) < 0)
        goto close_b1;
    p.limit = PyList_GET_SIZE(p.key1);
    if (p.b1.len < p.limit)
        p.limit = p.b1.len;
    if (p.group.len < p.limit)
        p.limit = p.group.len;
    if ((p.done = PyList_New(0)) == NULL || (p.fresh = PyList_New(0)) == NULL)
        goto close;
    for (i = 0; i < n; i++)
        if (publish_one(&p, i) < 0)
            goto close;
    ret = PyTuple_Pack(2, p.done, p.fresh);
close:
    PyBuffer_Release(&p.group.view);
close_b1:
    PyBuffer_Release(&p.b1.view);
out:
    Py_XDECREF(p.done);
    Py_XDECREF(p.fresh);
    Py_XDECREF(p.blocks);
    Py_XDECREF(p.keys);
    Py_XDECREF(p.bounds);
    return ret;
}

/* ------------------------------------------------------------------ release */

PyObject *kvr_release_refs(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

typedef struct {
    int32_t b1, group, id;
    PyObject *item; /* the caller's id object, borrowed from `ordered` and reused */
} zero_block;

/* policy.batch_order, in C: decreasing highest boundary, then ascending group, then id */
static inline int
before(const zero_block *a, const zero_block *b)
{
    if (a->b1 != b->b1)
        return a->b1 > b->b1; /* decreasing highest boundary */
    if (a->group != b->group)
        return a->group < b->group;
    return a->id < b->id;
}

static int
cmp_zero(const void *pa, const void *pb)
{
    const zero_block *a = pa, *b = pb;
    return before(a, b) ? -1 : before(b, a);
}

/* A list of the items of zb[0:n]. */
static PyObject *
items_list(const zero_block *zb, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    Py_ssize_t i;
    if (out != NULL)
        for (i = 0; i < n; i++)
            PyList_SET_ITEM(out, i, Py_NewRef(zb[i].item));
    return out;
}

/* release_refs(table, ordered) -> None | (unkeyed, keyed): `_release_each` (None when no
 * block reached 0), the keyed run in policy.batch_order. That order is checked before it is
 * sorted: the keyed blocks of one table, released in descending positions, usually come in it
 * already. */
PyObject *
kvr_release_refs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    flat ref, group, b1;
    PyObject *seq, *key1, *unkeyed = NULL, *keyed = NULL, *ret = NULL;
    zero_block *zb = NULL;
    kvr_table *t;
    Py_ssize_t i, n, limit, nu = 0, nk = 0;
    int multi, sorted = 1;
    if (check_args(nargs, 2, "release_refs") < 0 ||
        (t = kvr_table_arg(args[0], "release_refs")) == NULL)
        return NULL;
    key1 = t->key1;
    multi = PyList_GET_SIZE(t->index) > 1;
    if ((seq = PySequence_Fast(args[1], "release_refs: ordered must be iterable")) == NULL)
        return NULL;
    if (flat_open(t->ref, 4, "release_refs", &ref) < 0)
        goto out;
    if (flat_open(t->group, 1, "release_refs", &group) < 0)
        goto close_ref;
    if (flat_open(t->b1, 4, "release_refs", &b1) < 0)
        goto close_group;
    limit = ref.len;
    if (group.len < limit)
        limit = group.len;
    if (b1.len < limit)
        limit = b1.len;
    if (PyList_GET_SIZE(key1) < limit)
        limit = PyList_GET_SIZE(key1);
    n = PySequence_Fast_GET_SIZE(seq);
    /* unkeyed blocks fill zb from the front, keyed ones from the back (reversed below) */
    if ((zb = PyMem_Malloc(sizeof(zero_block) * (size_t)(n ? n : 1))) == NULL) {
        PyErr_NoMemory();
        goto close;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t b;
        zero_block *z;
        if (block_id(item, limit, &b) < 0)
            goto close;
        if (--I32(ref)[b] != 0)
            continue;
        if (PyList_GET_ITEM(key1, b) == Py_None) {
            I8(group)[b] = -1;
            z = &zb[nu++];
        }
        else {
            z = &zb[n - 1 - nk++];
            z->b1 = I32(b1)[b];
            z->group = multi ? I8(group)[b] : 0;
        }
        z->id = (int32_t)b;
        z->item = item;
    }
    if (nu + nk == 0) {
        ret = Py_NewRef(Py_None);
        goto close;
    }
    for (i = 0; i < nk / 2; i++) { /* the keyed run back in release order */
        zero_block t = zb[n - nk + i];
        zb[n - nk + i] = zb[n - 1 - i];
        zb[n - 1 - i] = t;
    }
    for (i = n - nk; i + 1 < n && sorted; i++)
        sorted = before(&zb[i], &zb[i + 1]);
    if (!sorted)
        qsort(zb + n - nk, (size_t)nk, sizeof *zb, cmp_zero);
    if ((unkeyed = items_list(zb, nu)) != NULL && (keyed = items_list(zb + n - nk, nk)) != NULL)
        ret = PyTuple_Pack(2, unkeyed, keyed);
close:
    PyBuffer_Release(&b1.view);
close_group:
    PyBuffer_Release(&group.view);
close_ref:
    PyBuffer_Release(&ref.view);
out:
    PyMem_Free(zb);
    Py_XDECREF(unkeyed);
    Py_XDECREF(keyed);
    Py_DECREF(seq);
    return ret;
}
