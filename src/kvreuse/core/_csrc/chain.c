/*
 * The chain kernel: the digests of a run of hash units, byte for byte the messages that
 * hashing.Chain.extend splices in Python.
 */
#include "kvr.h"

#define STACK_MSG 2048

/* ------------------------------------------------------------------ token words */

/* A read-only view of tokens [lo, hi) as native uint32: straight from a 4-byte unsigned
 * buffer (array('I')), else converted from any sequence of ints. */
typedef struct {
    Py_buffer view;
    int has_view;
    uint32_t *owned;
    const uint32_t *data;
} tokens_view;

static int
is_u32_format(const Py_buffer *v)
{
    const char *f = v->format;
    if (v->itemsize != 4 || f == NULL)
        return 0;
    if (f[0] == '@' || f[0] == '=')
        f++;
    return (f[0] == 'I' || f[0] == 'L') && f[1] == '\0';
}

static int
tokens_open(PyObject *obj, Py_ssize_t lo, Py_ssize_t hi, tokens_view *t)
{
    Py_ssize_t len, i;
    PyObject *seq;
    t->has_view = 0;
    t->owned = NULL;
    if (PyObject_CheckBuffer(obj) &&
        PyObject_GetBuffer(obj, &t->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        if (is_u32_format(&t->view) && t->view.ndim <= 1) {
            if (hi > t->view.len / 4) {
                PyBuffer_Release(&t->view);
                PyErr_SetString(PyExc_ValueError, "sha256_units: tokens end before the last unit");
                return -1;
            }
            t->has_view = 1;
            t->data = (const uint32_t *)t->view.buf + lo;
            return 0;
        }
        PyBuffer_Release(&t->view);
    }
    PyErr_Clear();
    seq = PySequence_Fast(obj, "sha256_units: tokens must be a sequence of ints");
    if (seq == NULL)
        return -1;
    len = PySequence_Fast_GET_SIZE(seq);
    if (hi > len) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "sha256_units: tokens end before the last unit");
        return -1;
    }
    t->owned = PyMem_Malloc(sizeof(uint32_t) * (size_t)(hi - lo > 0 ? hi - lo : 1));
    if (t->owned == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (i = lo; i < hi; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            PyMem_Free(t->owned);
            Py_DECREF(seq);
            return -1;
        }
        if (v > 0xFFFFFFFFUL) {
            PyMem_Free(t->owned);
            Py_DECREF(seq);
            PyErr_Format(PyExc_OverflowError, "token %lu out of range [0, 2**32)", v);
            return -1;
        }
        t->owned[i - lo] = (uint32_t)v;
    }
    Py_DECREF(seq);
    t->data = t->owned;
    return 0;
}

static void
tokens_close(tokens_view *t)
{
    if (t->has_view)
        PyBuffer_Release(&t->view);
    PyMem_Free(t->owned);
}

static void
put_words(unsigned char *dst, const uint32_t *src, Py_ssize_t n)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
#if PY_LITTLE_ENDIAN
        uint32_t v = __builtin_bswap32(src[i]);
#else
        uint32_t v = src[i];
#endif
        memcpy(dst + 4 * i, &v, 4);
    }
}

/* ------------------------------------------------------------------ hashing kernels */

static int
bytes_arg(PyObject *o, const char *name, const unsigned char **p, Py_ssize_t *n)
{
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "sha256_units: %s must be bytes", name);
        return -1;
    }
    *p = (const unsigned char *)PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o);
    return 0;
}

/* sha256(data, portable=False) -> bytes: one digest (tests compare both backends). */
PyObject *
kvr_sha256_digest(PyObject *self, PyObject *args)
{
    Py_buffer data;
    int portable = 0;
    unsigned char out[DIGEST_SIZE];
    if (!PyArg_ParseTuple(args, "y*|p", &data, &portable))
        return NULL;
    kvr_sha256(data.buf, (size_t)data.len, out, portable);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, DIGEST_SIZE);
}

/*
 * sha256_units(parent, pre, mid, la_hdr, tail, tokens, first, num_units, unit, lookahead
 *              [, portable]) -> list[bytes]
 *
 * The digests of `num_units` consecutive units, unit i covering tokens
 * [first + i*unit, first + (i+1)*unit), each message being
 *     pre | parent | mid | unit tokens | la_hdr | the `lookahead` tokens after it | tail
 * with tokens as 4-byte big-endian words, and each digest the next unit's parent. The bytes
 * are exactly those Chain.extend splices in Python.
 */
PyObject *
kvr_sha256_units(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const unsigned char *pre, *mid, *la_hdr, *tail, *parent;
    Py_ssize_t npre, nmid, nla_hdr, ntail, nparent, first, count, unit, la, i;
    Py_ssize_t off_parent, off_tok, off_la, off_succ, off_tail, total;
    int portable = 0;
    unsigned char stack_msg[STACK_MSG], *msg = stack_msg, md[DIGEST_SIZE];
    tokens_view tv;
    PyObject *out;
    if (nargs != 10 && nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "sha256_units takes 10 or 11 arguments");
        return NULL;
    }
    if (bytes_arg(args[0], "parent", &parent, &nparent) < 0 ||
        bytes_arg(args[1], "pre", &pre, &npre) < 0 || bytes_arg(args[2], "mid", &mid, &nmid) < 0 ||
        bytes_arg(args[3], "la_hdr", &la_hdr, &nla_hdr) < 0 ||
        bytes_arg(args[4], "tail", &tail, &ntail) < 0)
        return NULL;
    first = PyLong_AsSsize_t(args[6]);
    count = PyLong_AsSsize_t(args[7]);
    unit = PyLong_AsSsize_t(args[8]);
    la = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred())
        return NULL;
    if (nargs == 11 && (portable = PyObject_IsTrue(args[10])) < 0)
        return NULL;
    if (nparent != DIGEST_SIZE || first < 0 || count < 0 || unit < 1 || la < 0 ||
        unit > (PY_SSIZE_T_MAX / 8 - first) / (count + 1) || la > PY_SSIZE_T_MAX / 8 - unit) {
        PyErr_SetString(PyExc_ValueError, "sha256_units: bad parent, range, unit or lookahead");
        return NULL;
    }
    off_parent = npre;
    off_tok = off_parent + DIGEST_SIZE + nmid;
    off_la = off_tok + 4 * unit;
    off_succ = off_la + nla_hdr;
    off_tail = off_succ + 4 * la;
    total = off_tail + ntail;
    if (tokens_open(args[5], first, count ? first + count * unit + la : first, &tv) < 0)
        return NULL;
    out = PyList_New(count);
    if (out == NULL || (total > STACK_MSG && (msg = PyMem_Malloc((size_t)total)) == NULL)) {
        tokens_close(&tv);
        Py_XDECREF(out);
        return out == NULL ? NULL : PyErr_NoMemory();
    }
    memcpy(msg, pre, (size_t)npre);
    memcpy(msg + off_parent + DIGEST_SIZE, mid, (size_t)nmid);
    memcpy(msg + off_la, la_hdr, (size_t)nla_hdr);
    memcpy(msg + off_tail, tail, (size_t)ntail);
    memcpy(md, parent, DIGEST_SIZE);
    for (i = 0; i < count; i++) {
        PyObject *digest;
        memcpy(msg + off_parent, md, DIGEST_SIZE);
        put_words(msg + off_tok, tv.data + i * unit, unit);
        put_words(msg + off_succ, tv.data + (i + 1) * unit, la);
        kvr_sha256(msg, (size_t)total, md, portable);
        digest = PyBytes_FromStringAndSize((const char *)md, DIGEST_SIZE);
        if (digest == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, digest);
    }
    if (msg != stack_msg)
        PyMem_Free(msg);
    tokens_close(&tv);
    return out;
}
