/*
 * LRUPolicy's loops (policy.py) on its own arrays: nxt and prv (array('i')) thread the free queue
 * through block ids, with block 0 as the sentinel; inq (bytearray) flags queued blocks.
 */
#include "kvr.h"

PyObject *
kvr_lru_pop_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const Py_ssize_t sizes[] = {4, 4, 1};
    flat f[3];
    Py_ssize_t count, i, b;
    PyObject *out;
    if (check_args(nargs, 4, "lru_pop_many") < 0)
        return NULL;
    if ((count = PyLong_AsSsize_t(args[3])) < 0)
        return PyErr_Occurred() ? NULL : PyList_New(0);
    if (flats_open(args, sizes, 3, f) < 0)
        return NULL;
    if ((out = PyList_New(count)) == NULL)
        goto done;
    b = I32(f[0])[0];
    for (i = 0; i < count; i++) {
        PyObject *v;
        if (b <= 0 || b >= f[0].len || b >= f[2].len) {
            PyErr_SetString(PyExc_IndexError, "lru_pop_many: the free queue ended early");
            Py_CLEAR(out);
            goto done;
        }
        if ((v = PyLong_FromSsize_t(b)) == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
        U8(f[2])[b] = 0;
        b = I32(f[0])[b];
    }
    if (b < 0 || b >= f[1].len) {
        PyErr_SetString(PyExc_IndexError, "lru_pop_many: corrupt free queue");
        Py_CLEAR(out);
        goto done;
    }
    I32(f[0])[0] = (int32_t)b;
    I32(f[1])[b] = 0;
done:
    flats_close(f, 3);
    return out;
}

/* Link a run after `prev`; returns its last block, or -1 with an exception set. */
static Py_ssize_t
link_run(flat *f, PyObject *run, Py_ssize_t prev)
{
    Py_ssize_t i, n = PySequence_Fast_GET_SIZE(run), limit = f[0].len;
    PyObject **items = PySequence_Fast_ITEMS(run);
    if (f[1].len < limit)
        limit = f[1].len;
    if (f[2].len < limit)
        limit = f[2].len;
    for (i = 0; i < n; i++) {
        Py_ssize_t b;
        if (block_id(items[i], limit, &b) < 0)
            return -1;
        I32(f[0])[prev] = (int32_t)b;
        I32(f[1])[b] = (int32_t)prev;
        U8(f[2])[b] = 1;
        prev = b;
    }
    return prev;
}

/* lru_link(nxt, prv, inq, unkeyed, keyed): LRUPolicy.release's linking; the unkeyed run goes
 * in front of the head, the keyed run after the tail (the caller keeps the queue length). */
PyObject *
kvr_lru_link(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const Py_ssize_t sizes[] = {4, 4, 1};
    flat f[3];
    PyObject *unkeyed = NULL, *keyed = NULL, *ret = NULL;
    Py_ssize_t last;
    if (check_args(nargs, 5, "lru_link") < 0)
        return NULL;
    unkeyed = PySequence_Fast(args[3], "lru_link: unkeyed must be a sequence");
    keyed = unkeyed ? PySequence_Fast(args[4], "lru_link: keyed must be a sequence") : NULL;
    if (keyed == NULL || flats_open(args, sizes, 3, f) < 0)
        goto out;
    if (PySequence_Fast_GET_SIZE(unkeyed)) {
        int32_t old_head = I32(f[0])[0];
        if ((last = link_run(f, unkeyed, 0)) < 0)
            goto close;
        I32(f[0])[last] = old_head;
        I32(f[1])[old_head] = (int32_t)last;
    }
    if (PySequence_Fast_GET_SIZE(keyed)) {
        if ((last = link_run(f, keyed, I32(f[1])[0])) < 0)
            goto close;
        I32(f[0])[last] = 0;
        I32(f[1])[0] = (int32_t)last;
    }
    ret = Py_NewRef(Py_None);
close:
    flats_close(f, 3);
out:
    Py_XDECREF(unkeyed);
    Py_XDECREF(keyed);
    return ret;
}

/* ref_adopt(ref, blocks) -> list[int]: add one reference per block; the blocks whose count
 * was 0 (they leave the free queue: the caller removes them from its policy). */
