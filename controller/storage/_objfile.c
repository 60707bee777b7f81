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
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
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

/* The same store on threads of this module's own, which never take the GIL.
 *
 * A worker thread of Python's still takes the GIL to start a store and to
 * hand its answer back, each a wait for the event loop's thread. Here the
 * event loop submits a store (submit: no system call but a condition
 * signal), a thread of ours runs it, and its answer waits in a list until
 * the loop collects it, woken by an eventfd it watches (start returns it).
 *
 * start(threads) -> eventfd; submit(token, root, parts, name, data); collect()
 * -> [(token, answer, errno)], answer as put_new's (-3 failed, with errno).
 * ``token`` is any object, handed back as it was; ``data`` stays referenced
 * (its buffer held) until its answer is collected.
 */
struct job {
    struct job *next;
    PyObject *token;
    char *root, *name;
    char *parts[MAX_PARTS];
    int nparts;
    Py_buffer data;
    int answer, error;
};

static pthread_mutex_t jobs_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t jobs_wake = PTHREAD_COND_INITIALIZER;
static struct job *todo_head, *todo_tail, *done;
static int notify_fd = -1;

/* One store's arguments, copied so that it can run without the GIL. */
static char *copy_fs_name(PyObject *name)
{
    PyObject *encoded = NULL;
    if (!PyUnicode_FSConverter(name, &encoded))
        return NULL;
    char *out = strdup(PyBytes_AS_STRING(encoded));
    Py_DECREF(encoded);
    if (out == NULL)
        PyErr_NoMemory();
    return out;
}

/* With the GIL: the job's buffer and token let go, its memory freed. */
static void free_job(struct job *j)
{
    if (j->data.obj != NULL)
        PyBuffer_Release(&j->data);
    Py_XDECREF(j->token);
    free(j->root);
    free(j->name);
    for (int i = 0; i < j->nparts; i++)
        free(j->parts[i]);
    free(j);
}

/* A job for put_new's or submit's arguments; NULL with an exception set. */
static struct job *new_job(PyObject *root, PyObject *parts_arg, PyObject *name, PyObject *data)
{
    struct job *j = calloc(1, sizeof *j);
    if (j == NULL)
        return (struct job *)PyErr_NoMemory();
    PyObject *parts = PySequence_Fast(parts_arg, "parts must be a sequence");
    if (parts == NULL)
        goto fail;
    if (PySequence_Fast_GET_SIZE(parts) > MAX_PARTS) {
        PyErr_SetString(PyExc_ValueError, "too many directory parts");
        goto fail;
    }
    if ((j->root = copy_fs_name(root)) == NULL || (j->name = copy_fs_name(name)) == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(parts); i++) {
        if ((j->parts[i] = copy_fs_name(PySequence_Fast_GET_ITEM(parts, i))) == NULL)
            goto fail;
        j->nparts++;
    }
    if (PyObject_GetBuffer(data, &j->data, PyBUF_SIMPLE) != 0)
        goto fail;
    Py_DECREF(parts);
    return j;
fail:
    Py_XDECREF(parts);
    free_job(j);
    return NULL;
}

/* Without the GIL: the store, its answer and errno kept in the job. */
static void run_job(struct job *j)
{
    j->answer = store(j->root, (const char *const *)j->parts, j->nparts, j->name, j->data.buf,
                      j->data.len);
    j->error = j->answer == FAILED ? errno : 0;
}

/* Wake the event loop: answers wait to be collected. */
static void notify(void)
{
    uint64_t one = 1;
    while (write(notify_fd, &one, sizeof one) < 0 && errno == EINTR)
        ;
}

static PyObject *put_new(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *root, *parts, *name, *data;
    if (!PyArg_ParseTuple(args, "OOOO:put_new", &root, &parts, &name, &data))
        return NULL;
    struct job *j = new_job(root, parts, name, data);
    if (j == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    run_job(j);
    Py_END_ALLOW_THREADS
    PyObject *out;
    if (j->answer == FAILED) {
        errno = j->error;
        out = PyErr_SetFromErrno(PyExc_OSError);
    } else {
        out = PyLong_FromLong(j->answer);
    }
    free_job(j);
    return out;
}

static PyObject *submit(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *token, *root, *parts, *name, *data;
    if (!PyArg_ParseTuple(args, "OOOOO:submit", &token, &root, &parts, &name, &data))
        return NULL;
    if (notify_fd < 0) {
        PyErr_SetString(PyExc_RuntimeError, "start() first");
        return NULL;
    }
    struct job *j = new_job(root, parts, name, data);
    if (j == NULL)
        return NULL;
    Py_INCREF(token);
    j->token = token;
    pthread_mutex_lock(&jobs_lock);
    if (todo_tail != NULL)
        todo_tail->next = j;
    else
        todo_head = j;
    todo_tail = j;
    pthread_cond_signal(&jobs_wake);
    pthread_mutex_unlock(&jobs_lock);
    Py_RETURN_NONE;
}

static void *worker(void *unused)
{
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&jobs_lock);
        while (todo_head == NULL)
            pthread_cond_wait(&jobs_wake, &jobs_lock);
        struct job *j = todo_head;
        todo_head = j->next;
        if (todo_head == NULL)
            todo_tail = NULL;
        pthread_mutex_unlock(&jobs_lock);
        run_job(j);
        pthread_mutex_lock(&jobs_lock);
        j->next = done;
        done = j;
        pthread_mutex_unlock(&jobs_lock);
        notify();
    }
    return NULL;
}

static PyObject *start(PyObject *self, PyObject *args)
{
    (void)self;
    int threads;
    if (!PyArg_ParseTuple(args, "i:start", &threads))
        return NULL;
    if (notify_fd >= 0)
        return PyLong_FromLong(notify_fd);
    if (threads < 1 || threads > 64) {
        PyErr_SetString(PyExc_ValueError, "threads must be 1 to 64");
        return NULL;
    }
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    /* Signals stay with Python's main thread: the workers block them all. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int made = 0, err = 0;
    for (; made < threads; made++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        err = pthread_create(&t, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (err != 0)
            break;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (made == 0) {
        close(fd);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    notify_fd = fd;
    return PyLong_FromLong(notify_fd);
}

/* Put answers back to be collected again (the loop is woken again). */
static void put_back(struct job *first)
{
    if (first == NULL)
        return;
    struct job *last = first;
    while (last->next != NULL)
        last = last->next;
    pthread_mutex_lock(&jobs_lock);
    last->next = done;
    done = first;
    pthread_mutex_unlock(&jobs_lock);
    notify();
}

static PyObject *collect(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    uint64_t count;
    if (notify_fd >= 0)
        while (read(notify_fd, &count, sizeof count) < 0 && errno == EINTR)
            ;
    pthread_mutex_lock(&jobs_lock);
    struct job *first = done;
    done = NULL;
    pthread_mutex_unlock(&jobs_lock);
    Py_ssize_t n = 0;
    for (struct job *j = first; j != NULL; j = j->next)
        n++;
    /* Every answer is built before any job is freed: where memory runs out
     * the jobs go back whole, and a later collect() hands them over. */
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        put_back(first);
        return NULL;
    }
    Py_ssize_t i = 0;
    for (struct job *j = first; j != NULL; j = j->next, i++) {
        PyObject *item = Py_BuildValue("(Oii)", j->token, j->answer, j->error);
        if (item == NULL) {
            Py_DECREF(out);
            put_back(first);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    while (first != NULL) {
        struct job *next = first->next;
        free_job(first);
        first = next;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"put_new", put_new, METH_VARARGS,
     "put_new(root, parts, name, data) -> 1 stored, 0 exists, -1 no directory, -2 no O_TMPFILE"},
    {"start", start, METH_VARARGS, "start(threads) -> the eventfd that says answers wait"},
    {"submit", submit, METH_VARARGS, "submit(token, root, parts, name, data): a store to run"},
    {"collect", collect, METH_NOARGS, "collect() -> [(token, answer, errno)]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "controller.storage._objfile",
    "A new small object's whole store, with the GIL released once.", -1, methods,
};

PyMODINIT_FUNC PyInit__objfile(void) { return PyModule_Create(&module); }
