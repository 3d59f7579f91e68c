/*
 * The C ghost record's Python type, `kvreuse.core._native.Ghost`: GhostRecord's interface
 * (ghost.py) over the ring and table of ghost.c.
 */
#include "ghost.h"

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
    ghost_drop_all(g);
    g->num_groups = num_groups;
    g->capacity = capacity;
    return ghost_table_rebuild(g, 0);
}

static void
Ghost_dealloc(Ghost *g)
{
    ghost_drop_all(g);
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
              ghost_group_of(g, PyTuple_GET_ITEM(row, 0), &gid) < 0 ||
              ghost_add_one(g, gid, PyTuple_GET_ITEM(row, 1), boundary) < 0;
    }
    Py_DECREF(seq);
    ghost_trim(g); /* the rows added before an error are kept, within capacity */
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
    if ((boundary == -1 && PyErr_Occurred()) || ghost_group_of(g, args[0], &gid) < 0 ||
        ghost_add_one(g, gid, args[1], boundary) < 0)
        return NULL;
    ghost_trim(g);
    Py_RETURN_NONE;
}

static PyObject *
Ghost_discard(Ghost *g, PyObject *const *args, Py_ssize_t nargs)
{
    int gid;
    if (check_args(nargs, 2, "discard") < 0 || ghost_group_of(g, args[0], &gid) < 0 ||
        ghost_discard_one(g, gid, args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
Ghost_discard_many(Ghost *g, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq;
    Py_ssize_t i, n;
    int gid;
    if (check_args(nargs, 2, "discard_many") < 0 || ghost_group_of(g, args[0], &gid) < 0)
        return NULL;
    if (g->size == 0)
        Py_RETURN_NONE;
    if ((seq = PySequence_Fast(args[1], "ghost: discard_many takes a sequence of keys")) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    for (i = 0; i < n && g->size; i++) {
        if (ghost_discard_one(g, gid, PySequence_Fast_GET_ITEM(seq, i)) < 0) {
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
    if (check_args(nargs, 2, "contains") < 0 || ghost_group_of(g, args[0], &gid) < 0 ||
        (r = ghost_has(g, gid, args[1])) < 0)
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
    if (ghost_group_of(g, PyTuple_GET_ITEM(item, 0), &gid) < 0)
        return -1;
    return ghost_has(g, gid, PyTuple_GET_ITEM(item, 1));
}

static Py_ssize_t
Ghost_len(Ghost *g)
{
    return g->size;
}

static PyObject *
Ghost_clear(Ghost *g, PyObject *unused)
{
    ghost_drop_all(g);
    if (ghost_table_rebuild(g, 0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The live slots oldest first, as rows of one shape: (gid, key), (gid, boundary, key) for
 * entries(), or (gid, key, boundary), add_many's triples, for pickling. */
enum row_shape { ROW_KEY, ROW_ENTRY, ROW_TRIPLE };

static PyObject *
rows(Ghost *g, enum row_shape shape)
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
        if (shape == ROW_ENTRY)
            row = Py_BuildValue("(iLO)", s->gid, s->boundary, s->key);
        else if (shape == ROW_TRIPLE)
            row = Py_BuildValue("(iOL)", s->gid, s->key, s->boundary);
        else
            row = Py_BuildValue("(iO)", s->gid, s->key);
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
    return rows(g, ROW_ENTRY);
}

static PyObject *
Ghost_iter(Ghost *g)
{
    PyObject *list = rows(g, ROW_KEY), *it;
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
    PyObject *state = rows(g, ROW_TRIPLE), *ret;
    if (state == NULL)
        return NULL;
    ret = Py_BuildValue("(O(nn)O)", Py_TYPE(g), g->num_groups, g->capacity, state);
    Py_DECREF(state);
    return ret;
}

static PyObject *
Ghost_setstate(Ghost *g, PyObject *state)
{
    PyObject *r;
    ghost_drop_all(g);
    if (ghost_table_rebuild(g, 0) < 0)
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
