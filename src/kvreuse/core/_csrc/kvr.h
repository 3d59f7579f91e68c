/*
 * Shared declarations of the C kernels (kvreuse.core._native); module.c says what they are.
 */
#ifndef KVR_H
#define KVR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGEST_SIZE 32

/* sha256.c: SHA-256 through libcrypto (found at import) or the portable code */
void kvr_sha256_load(void);
void kvr_sha256(const unsigned char *msg, size_t len, unsigned char *out, int portable);
const char *kvr_sha256_backend(void);
const char *kvr_sha256_library(void);

/* chain.c: the hashing kernels */
PyObject *kvr_sha256_digest(PyObject *self, PyObject *args);
PyObject *kvr_sha256_units(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* queue.c: LRUPolicy's loops */
PyObject *kvr_lru_pop_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvr_lru_link(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* pool.c: BlockPool's loops */
PyObject *kvr_ref_adopt(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvr_evict_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* ghost.c, ghost_type.c: the ghost record as a C type (ghost.GhostRecord's interface); the
 * eviction kernel adds keys and trims through these two */
extern PyTypeObject kvr_GhostType;
int kvr_ghost_add(PyObject *ghost, int gid, PyObject *key, PyObject *boundary);
void kvr_ghost_trim(PyObject *ghost);

/* table.c: the pool's per-block state, bound once for the kernels below */
typedef struct {
    PyObject_HEAD PyObject *ref, *group, *b1, *key1, *more, *index;
} kvr_table;
extern PyTypeObject kvr_TableType;
kvr_table *kvr_table_arg(PyObject *o, const char *name);

/* ------------------------------------------------------------------ the owners' flat arrays */

/* The owners' flat arrays (array('i'), array('b'), bytearray), borrowed writable for one call. */
typedef struct {
    Py_buffer view;
    Py_ssize_t len;
} flat;

static inline int
flat_open(PyObject *o, Py_ssize_t itemsize, const char *name, flat *f)
{
    if (PyObject_GetBuffer(o, &f->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (f->view.itemsize != itemsize) {
        PyBuffer_Release(&f->view);
        PyErr_Format(PyExc_TypeError, "%s: expected %zd-byte items", name, itemsize);
        return -1;
    }
    f->len = f->view.len / itemsize;
    return 0;
}

#define I32(f) ((int32_t *)(f).view.buf)
#define I8(f) ((int8_t *)(f).view.buf)
#define U8(f) ((uint8_t *)(f).view.buf)

static inline void
flats_close(flat *fs, int n)
{
    int i;
    for (i = 0; i < n; i++)
        PyBuffer_Release(&fs[i].view);
}

/* Open n flats (args[i] with itemsize sizes[i]); on failure nothing stays open. */
static inline int
flats_open(PyObject *const *args, const Py_ssize_t *sizes, int n, flat *fs)
{
    int i;
    for (i = 0; i < n; i++) {
        if (flat_open(args[i], sizes[i], "native kernel", &fs[i]) < 0) {
            flats_close(fs, i);
            return -1;
        }
    }
    return 0;
}

/* A block id read from a sequence item, checked against [0, limit). */
static inline int
block_id(PyObject *item, Py_ssize_t limit, Py_ssize_t *out)
{
    Py_ssize_t b = PyLong_AsSsize_t(item);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (b < 0 || b >= limit) {
        PyErr_Format(PyExc_IndexError, "block id %zd out of range [0, %zd)", b, limit);
        return -1;
    }
    *out = b;
    return 0;
}

static inline int
check_args(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* lru_pop_many(nxt, prv, inq, count) -> list[int]: LRUPolicy.pop_many's unlinking (the
 * caller checked count against the queue length and keeps that length). */

#endif /* KVR_H */
