/* A new small object's whole store in C, with the GIL released once.
 *
 * controller.storage.local_disk stores a body held in memory (an upload of
 * up to 64 KiB) as an anonymous file in the object's directory, synced,
 * linked into place, and the directory synced: about sixteen system calls.
 * In Python each of them gives the GIL up and takes it back, and on a busy
 * event loop each taking back is a wait for the loop's thread and a wake-up
 * of this one: the controller spent more CPU on those hand-overs than on
 * the calls. Here the calls run in one stretch without the GIL.
 *
 * put_new(root, parts, name, data) -> int, the same steps as
 * LocalDiskProvider.put_bytes with its directories already there:
 *   1   stored: ``data`` is synced, linked as ``root/parts.../name``, and the
 *       directory synced (when that last sync fails the link is removed
 *       again and OSError raised, so a retry never finds an object that a
 *       crash could still lose);
 *   0   ``name`` exists already (before, or a concurrent put linked it first);
 *  -1   a directory of ``parts`` is missing (the caller makes it and stores
 *       the Python way);
 *  -2   the filesystem makes no anonymous files (O_TMPFILE refused: the
 *       caller stores the Python way, through a named temp file).
 * Any other failure raises OSError. No directory is followed through a
 * symlink (O_NOFOLLOW), nor is ``name`` (it is only looked at, with lstat).
 * ``root``, ``parts`` and ``name`` are str (encoded as os.fsencode does) or
 * bytes; ``data`` any contiguous buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#define DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
#define MAX_PARTS 8

enum { STORED = 1, EXISTS = 0, NO_DIRECTORY = -1, NO_TMPFILE = -2, FAILED = -3 };

static int write_all(int fd, const char *buf, Py_ssize_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, (size_t)len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += n;
        len -= n;
    }
    return 0;
}

/* The steps, without the GIL; FAILED with errno set. */
static int store(const char *root, const char *const *parts, int nparts, const char *name,
                 const char *data, Py_ssize_t len)
{
    int dir = open(root, DIR_FLAGS);
    if (dir < 0)
        return errno == ENOENT ? NO_DIRECTORY : FAILED;
    for (int i = 0; i < nparts; i++) {
        int child = openat(dir, parts[i], DIR_FLAGS);
        int saved = errno;
        close(dir);
        if (child < 0) {
            errno = saved;
            return saved == ENOENT ? NO_DIRECTORY : FAILED;
        }
        dir = child;
    }
    int result = FAILED, saved = 0;
    struct stat st;
    if (fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        result = EXISTS;
        goto out;
    }
    if (errno != ENOENT)
        goto out;
    int fd = openat(dir, ".", O_RDWR | O_TMPFILE | O_CLOEXEC, 0600);
    if (fd < 0) {
        if (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)
            result = NO_TMPFILE;
        goto out;
    }
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    if (write_all(fd, data, len) != 0 || fsync(fd) != 0) {
        saved = errno;
        close(fd);
        errno = saved;
        goto out;
    }
    if (linkat(AT_FDCWD, proc, dir, name, AT_SYMLINK_FOLLOW) != 0) {
        saved = errno;
        close(fd);
        errno = saved;
        if (saved == EEXIST)
            result = EXISTS;
        goto out;
    }
    close(fd);
    if (fsync(dir) != 0) {
        saved = errno;
        unlinkat(dir, name, 0);
        errno = saved;
        goto out;
    }
    result = STORED;
out:
    saved = errno;
    close(dir);
    errno = saved;
    return result;
}

static PyObject *put_new(PyObject *self, PyObject *args)
{
    PyObject *root = NULL, *parts_arg, *name = NULL, *parts = NULL, *out = NULL;
    PyObject *encoded[MAX_PARTS];
    const char *part_names[MAX_PARTS];
    Py_buffer data = {0};
    int nparts = 0;

    if (!PyArg_ParseTuple(args, "O&OO&y*:put_new", PyUnicode_FSConverter, &root, &parts_arg,
                          PyUnicode_FSConverter, &name, &data))
        goto done;
    parts = PySequence_Fast(parts_arg, "parts must be a sequence");
    if (parts == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(parts) > MAX_PARTS) {
        PyErr_SetString(PyExc_ValueError, "too many directory parts");
        goto done;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(parts); i++) {
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(parts, i), &encoded[nparts]))
            goto done;
        part_names[nparts] = PyBytes_AS_STRING(encoded[nparts]);
        nparts++;
    }
    int result;
    Py_BEGIN_ALLOW_THREADS
    result = store(PyBytes_AS_STRING(root), part_names, nparts, PyBytes_AS_STRING(name),
                   data.buf, data.len);
    Py_END_ALLOW_THREADS
    if (result == FAILED)
        PyErr_SetFromErrno(PyExc_OSError);
    else
        out = PyLong_FromLong(result);
done:
    for (int i = 0; i < nparts; i++)
        Py_DECREF(encoded[i]);
    if (data.obj != NULL)
        PyBuffer_Release(&data);
    Py_XDECREF(parts);
    Py_XDECREF(root);
    Py_XDECREF(name);
    return out;
}

static PyMethodDef methods[] = {
    {"put_new", put_new, METH_VARARGS,
     "put_new(root, parts, name, data) -> 1 stored, 0 exists, -1 no directory, -2 no O_TMPFILE"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "controller.storage._objfile",
    "A new small object's whole store, with the GIL released once.", -1, methods,
};

PyMODINIT_FUNC PyInit__objfile(void) { return PyModule_Create(&module); }
