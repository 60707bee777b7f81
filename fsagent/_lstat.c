/* The scan's hot loop in C: lstat a list of paths below a directory fd.
 *
 * fsagent.scan.engine lstats every member of a checkout at every checkpoint. In
 * Python each os.lstat costs about three times its system call (the path
 * converted, a stat_result of 19 fields built, six attributes read back),
 * and the GIL is taken back after every call. Here the calls run in batches
 * with the GIL released and only the six fields a scan keys on are built.
 *
 * lstat_keys(dir_fd, paths[, previous]) -> list of (dev, ino, size, mode,
 * mtime_ns, ctime_ns) or None, one per path, exactly as the Python loop in
 * fsagent/scan/engine.py (_lstat_list_py) builds them: None for a path that does
 * not exist (ENOENT) or lies below a non-directory (ENOTDIR); any other
 * error raises OSError naming the path, as os.lstat would. Paths are str,
 * encoded as os.fsencode does where the file system encoding is UTF-8 with
 * surrogate escapes (the only place fsagent.scan.engine uses it); a NUL raises
 * ValueError. ``previous`` (a list as long as ``paths``: the keys of the
 * same paths last time) gives back its own tuple for a path whose key is
 * unchanged: nothing is built for what did not change, and the caller
 * compares unchanged keys by identity.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

#define BATCH 512

struct key {
    unsigned long long dev, ino;
    long long size;
    unsigned int mode;
    long long mtime_s, mtime_ns, ctime_s, ctime_ns;
    int error;
};

/* seconds * 10**9 + nanoseconds in *out; 0 when that does not fit in 64
 * bits (ext4 keeps times past 2262). */
static int ns_fits(long long s, long long ns, long long *out)
{
    long long product;
    return !__builtin_mul_overflow(s, 1000000000LL, &product) &&
           !__builtin_add_overflow(product, ns, out);
}

/* seconds * 10**9 + nanoseconds, exactly. */
static PyObject *nanoseconds(long long s, long long ns)
{
    long long sum;
    if (ns_fits(s, ns, &sum))
        return PyLong_FromLongLong(sum);
    PyObject *a = PyLong_FromLongLong(s), *b = NULL, *c = NULL, *d = NULL, *out = NULL;
    if (a && (b = PyLong_FromLongLong(1000000000LL)) && (c = PyNumber_Multiply(a, b)) &&
        (d = PyLong_FromLongLong(ns)))
        out = PyNumber_Add(c, d);
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    Py_XDECREF(d);
    return out;
}

/* The last device and mode built, used again: one device for a whole scan,
 * a handful of modes. */
struct reuse {
    unsigned long long dev;
    unsigned int mode;
    PyObject *dev_obj, *mode_obj;
};

static PyObject *cached_dev(struct reuse *r, unsigned long long dev)
{
    if (r->dev_obj == NULL || r->dev != dev) {
        PyObject *obj = PyLong_FromUnsignedLongLong(dev);
        if (obj == NULL)
            return NULL;
        Py_XSETREF(r->dev_obj, obj);
        r->dev = dev;
    }
    return Py_NewRef(r->dev_obj);
}

static PyObject *cached_mode(struct reuse *r, unsigned int mode)
{
    if (r->mode_obj == NULL || r->mode != mode) {
        PyObject *obj = PyLong_FromUnsignedLong(mode);
        if (obj == NULL)
            return NULL;
        Py_XSETREF(r->mode_obj, obj);
        r->mode = mode;
    }
    return Py_NewRef(r->mode_obj);
}

static PyObject *key_tuple(const struct key *k, struct reuse *r)
{
    PyObject *t = PyTuple_New(6);
    if (t == NULL)
        return NULL;
    PyObject *items[6] = {
        cached_dev(r, k->dev),
        PyLong_FromUnsignedLongLong(k->ino),
        PyLong_FromLongLong(k->size),
        cached_mode(r, k->mode),
        nanoseconds(k->mtime_s, k->mtime_ns),
        nanoseconds(k->ctime_s, k->ctime_ns),
    };
    int failed = 0;
    for (int i = 0; i < 6; i++) {
        if (items[i] == NULL)
            failed = 1;
        PyTuple_SET_ITEM(t, i, items[i]); /* NULL slots are fine for Py_DECREF */
    }
    if (failed) {
        Py_DECREF(t);
        return NULL;
    }
    /* Six ints cannot take part in a cycle: the collector need never visit
     * the tuple (it would untrack it at its first pass anyway, after
     * visiting it; a scan makes one per member). */
    PyObject_GC_UnTrack(t);
    return t;
}

/* Whether ``prev`` is a key tuple of exactly these values. */
static int same_key(PyObject *prev, const struct key *k)
{
    if (!PyTuple_CheckExact(prev) || PyTuple_GET_SIZE(prev) != 6)
        return 0;
    long long times[2];
    if (!ns_fits(k->mtime_s, k->mtime_ns, &times[0]) ||
        !ns_fits(k->ctime_s, k->ctime_ns, &times[1]))
        return 0; /* past 2262: built afresh */
    for (int i = 0; i < 6; i++) {
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(prev, i)))
            return 0;
    }
    int overflow;
    unsigned long long dev = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(prev, 0));
    unsigned long long ino = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(prev, 1));
    long long size = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(prev, 2), &overflow);
    int bad = overflow;
    long long mode = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(prev, 3), &overflow);
    bad |= overflow;
    long long mtime = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(prev, 4), &overflow);
    bad |= overflow;
    long long ctime = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(prev, 5), &overflow);
    bad |= overflow;
    if (PyErr_Occurred()) { /* a negative or huge device or inode: not ours */
        PyErr_Clear();
        return 0;
    }
    return !bad && dev == k->dev && ino == k->ino && size == k->size &&
           mode == (long long)k->mode && mtime == times[0] && ctime == times[1];
}

static PyObject *lstat_keys(PyObject *self, PyObject *args)
{
    int dir_fd;
    PyObject *paths, *previous = Py_None;
    if (!PyArg_ParseTuple(args, "iO!|O:lstat_keys", &dir_fd, &PyList_Type, &paths, &previous))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(paths);
    if (previous == Py_None) {
        previous = NULL;
    } else if (!PyList_Check(previous) || PyList_GET_SIZE(previous) != count) {
        PyErr_SetString(PyExc_ValueError,
                        "lstat_keys: previous must be a list as long as paths, or None");
        return NULL;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL)
        return NULL;
    PyObject *held[BATCH];    /* the paths, held while the GIL is released */
    PyObject *encoded[BATCH]; /* a new bytes object, or NULL: the str's own UTF-8 */
    const char *names[BATCH];
    struct key keys[BATCH];
    struct reuse reuse = {0, 0, NULL, NULL};
    for (Py_ssize_t start = 0; start < count; start += BATCH) {
        Py_ssize_t n = count - start < BATCH ? count - start : BATCH;
        Py_ssize_t got = 0;
        if (PyList_GET_SIZE(paths) != count ||
            (previous != NULL && PyList_GET_SIZE(previous) != count)) {
            /* another thread changed a list while the GIL was released */
            PyErr_SetString(PyExc_RuntimeError, "lstat_keys: a list changed size during the call");
            got = -1;
        }
        for (; got >= 0 && got < n; got++) {
            PyObject *path = PyList_GET_ITEM(paths, start + got);
            if (!PyUnicode_Check(path)) {
                PyErr_Format(PyExc_TypeError, "lstat_keys: a path must be str, not %.100s",
                             Py_TYPE(path)->tp_name);
                break;
            }
            /* UTF-8 is the file system encoding (fsagent.scan.engine uses this module
             * only then); a str keeps its UTF-8 (free for ASCII). A name that
             * is not UTF-8 (surrogate escapes) is encoded as os.fsencode does. */
            Py_ssize_t size;
            const char *utf8 = PyUnicode_AsUTF8AndSize(path, &size);
            PyObject *raw = NULL;
            if (utf8 == NULL) {
                PyErr_Clear();
                raw = PyUnicode_EncodeFSDefault(path);
                if (raw == NULL)
                    break;
                utf8 = PyBytes_AS_STRING(raw);
                size = PyBytes_GET_SIZE(raw);
            }
            if ((size_t)size != strlen(utf8)) {
                Py_XDECREF(raw);
                PyErr_SetString(PyExc_ValueError, "lstat_keys: embedded null byte");
                break;
            }
            held[got] = Py_NewRef(path);
            encoded[got] = raw;
            names[got] = utf8;
        }
        if (got < n) {
            for (Py_ssize_t i = 0; i < got; i++) {
                Py_DECREF(held[i]);
                Py_XDECREF(encoded[i]);
            }
            Py_DECREF(out);
            Py_XDECREF(reuse.dev_obj);
            Py_XDECREF(reuse.mode_obj);
            return NULL;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            struct stat st;
            struct key *k = &keys[i];
            if (fstatat(dir_fd, names[i], &st, AT_SYMLINK_NOFOLLOW) != 0) {
                k->error = errno;
                continue;
            }
            k->error = 0;
            k->dev = (unsigned long long)st.st_dev;
            k->ino = (unsigned long long)st.st_ino;
            k->size = (long long)st.st_size;
            k->mode = (unsigned int)st.st_mode;
            k->mtime_s = (long long)st.st_mtim.tv_sec;
            k->mtime_ns = (long long)st.st_mtim.tv_nsec;
            k->ctime_s = (long long)st.st_ctim.tv_sec;
            k->ctime_ns = (long long)st.st_ctim.tv_nsec;
        }
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item;
            if (keys[i].error == ENOENT || keys[i].error == ENOTDIR) {
                item = Py_NewRef(Py_None);
            } else if (keys[i].error != 0) {
                errno = keys[i].error;
                PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, held[i]);
                item = NULL;
            } else if (previous != NULL && PyList_GET_SIZE(previous) == count &&
                       same_key(PyList_GET_ITEM(previous, start + i), &keys[i])) {
                item = Py_NewRef(PyList_GET_ITEM(previous, start + i));
            } else {
                item = key_tuple(&keys[i], &reuse);
            }
            if (item == NULL) {
                for (Py_ssize_t j = i; j < n; j++) {
                    Py_DECREF(held[j]);
                    Py_XDECREF(encoded[j]);
                }
                Py_DECREF(out);
                Py_XDECREF(reuse.dev_obj);
                Py_XDECREF(reuse.mode_obj);
                return NULL;
            }
            PyList_SET_ITEM(out, start + i, item);
            Py_DECREF(held[i]);
            Py_XDECREF(encoded[i]);
        }
    }
    Py_XDECREF(reuse.dev_obj);
    Py_XDECREF(reuse.mode_obj);
    return out;
}

static PyMethodDef methods[] = {
    {"lstat_keys", lstat_keys, METH_VARARGS,
     "lstat_keys(dir_fd, paths, previous=None) -> [(dev, ino, size, mode, mtime_ns, ctime_ns)"
     " | None]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fsagent._lstat",
    "The scan's lstat loop in C (see fsagent/_lstat.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__lstat(void)
{
    return PyModule_Create(&module);
}
