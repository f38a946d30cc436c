/*
 * powercut.c: an LD_PRELOAD interposer that records what a power cut could undo.
 *
 * Under a program that does its own I/O in C (SQLite, a PostgreSQL server and all
 * its processes), every change to a regular file under AGCK_POWERCUT_DIR is
 * appended to the binary log AGCK_POWERCUT_LOG before it is made, with the bytes
 * it overwrites, and every successful fsync/fdatasync of such a file or directory
 * is appended after it returns. After every writer has been SIGKILLed,
 * crashtests/powercut.py reads the log and rebuilds the files as a power cut
 * would have left them: the last synced content, plus none, a prefix, a torn
 * prefix or a random subset of what was written since. Without
 * AGCK_POWERCUT_DIR every call passes straight through.
 *
 * Intercepted: write, pwrite(64), writev, pwritev(64), pwritev2, pwritev64v2,
 * ftruncate(64), truncate(64), fallocate(64), posix_fallocate(64), fsync,
 * fdatasync, sync, syncfs, and the open family (open(64), openat(64), creat(64),
 * __open_2, __open64_2, __openat_2, __openat64_2) for O_CREAT (the CREATE of a
 * file that did not exist) and O_TRUNC (a truncation to 0). close, dup2 and dup3
 * only keep the per-fd cache honest.
 *
 * Limits (each one lenient: the change is treated as durable at once):
 *   - renames, unlinks, mkdir, links are durable immediately;
 *   - writes through mmap, stdio's internal calls (fwrite), sendfile, splice,
 *     copy_file_range and raw syscalls are not seen;
 *   - fallocate's COLLAPSE_RANGE and INSERT_RANGE pass through unrecorded;
 *   - a write made by a signal handler while this library is busy in the same
 *     thread, or holds the append lock, is not recorded (the recursion guard
 *     sees it as our own);
 *   - O_TMPFILE files (created without a name) are not CREATEd.
 * sync_file_range is a hint, not durability: it is left alone.
 *
 * Ordering. The log is one total order (each record is one writev() call on an
 * O_APPEND file, which the kernel appends atomically). A WRITE or TRUNC record is
 * appended before the real call, a SYNC record after the real fsync returns 0.
 * A program may count a write as durable only if the write returned before some
 * fsync of its file was called, and that fsync returned: then the WRITE record
 * precedes the write, which precedes the fsync, which precedes the SYNC record,
 * so the log shows the write before the SYNC and the harness keeps it. Never a
 * false loss. Conversely a write logged after a SYNC began after that fsync had
 * ended, so that fsync did not cover it. The one imprecision is lenient: a write
 * logged before a SYNC but racing the fsync (issued, not finished, when the fsync
 * began) is treated as synced though the disk might not have it. A process killed
 * between a WRITE record and its write leaves a record of a write in flight;
 * whether the harness then keeps it or not, the program never saw it return.
 * A failed or short write is corrected by a RESULT record appended after it.
 * CREATE needs the new inode, so it is appended after the open, but before the
 * open returns: any fsync of the directory the program can rely on starts after
 * the open returned, so it is logged after the CREATE.
 *
 * Log format (native byte order; read on the machine that wrote it). The file
 * starts with the 8 bytes "AGCKPC" VERSION "\n" (VERSION = 1), written by
 * powercut.env() or, failing that, by the process that finds the log empty. Then
 * records, each:
 *   head   u32 magic 0x52435041, u8 type, u8 flags, u16 0, u32 pid, u32 0,
 *          u64 seq (per process: pid and seq name the record for a RESULT),
 *          u64 len (of the whole record, head to trailer)            32 bytes
 *   body   by type, below
 *   trail  u64 len ^ 0x5A17C0DE5A17C0DE (a record torn by a SIGKILL is told by it)
 * Types and bodies:
 *   1 WRITE  u64 dev, u64 ino, i64 offset, u64 length, u64 old size,
 *            u64 pre length; pre-image bytes (the old bytes at [offset, offset +
 *            length) below the old size), then the data (length bytes; none
 *            with flag ZEROS)
 *   2 TRUNC  u64 dev, u64 ino, u64 old size, u64 new size, u64 tail length;
 *            the removed tail [new size, old size) when shrinking
 *   3 SYNC   u64 dev, u64 ino (a file or a directory, after fsync/fdatasync)
 *   4 CREATE u64 dev, u64 ino, u64 parent dev, u64 parent ino, u64 path length;
 *            the path
 *   5 RESULT i64 result: the WRITE or TRUNC of the same pid and seq did not do
 *            what it said: -1 it failed (never happened), else the bytes written
 *   6 SYNCFS u64 dev: syncfs() of that file system, or sync() with flag ALL
 * Flags: 1 ZEROS (the data is zeros, not stored), 2 NOPRE (the old bytes could
 * not be read: the op cannot be reverted), 4 SYNCIO (O_SYNC/O_DSYNC/RWF_DSYNC:
 * durable once it returned), 8 ALL.
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define LOG_MAGIC 0x52435041u
#define TRAIL_XOR 0x5A17C0DE5A17C0DEull
#define VERSION 1

enum { R_WRITE = 1, R_TRUNC = 2, R_SYNC = 3, R_CREATE = 4, R_RESULT = 5, R_SYNCFS = 6 };
enum { F_ZEROS = 1, F_NOPRE = 2, F_SYNCIO = 4, F_ALL = 8 };

#ifndef RWF_DSYNC
#define RWF_DSYNC 0x2
#endif
#ifndef RWF_SYNC
#define RWF_SYNC 0x4
#endif
#ifndef RWF_APPEND
#define RWF_APPEND 0x10
#endif
#ifndef FALLOC_FL_KEEP_SIZE
#define FALLOC_FL_KEEP_SIZE 0x01
#endif
#ifndef FALLOC_FL_PUNCH_HOLE
#define FALLOC_FL_PUNCH_HOLE 0x02
#endif
#ifndef FALLOC_FL_ZERO_RANGE
#define FALLOC_FL_ZERO_RANGE 0x10
#endif
#define NEEDS_MODE(fl) (((fl) & O_CREAT) || ((fl) & O_TMPFILE) == O_TMPFILE)

struct head {
    uint32_t magic;
    uint8_t type, flags;
    uint16_t zero;
    uint32_t pid, zero2;
    uint64_t seq, len;
};

/* ---- the real functions ------------------------------------------------------ */

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off64_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);
static ssize_t (*real_pwritev64)(int, const struct iovec *, int, off64_t);
static ssize_t (*real_pwritev2)(int, const struct iovec *, int, off_t, int);
static ssize_t (*real_pwritev64v2)(int, const struct iovec *, int, off64_t, int);
static int (*real_ftruncate)(int, off_t);
static int (*real_ftruncate64)(int, off64_t);
static int (*real_truncate)(const char *, off_t);
static int (*real_truncate64)(const char *, off64_t);
static int (*real_fallocate)(int, int, off_t, off_t);
static int (*real_fallocate64)(int, int, off64_t, off64_t);
static int (*real_posix_fallocate)(int, off_t, off_t);
static int (*real_posix_fallocate64)(int, off64_t, off64_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static void (*real_sync)(void);
static int (*real_syncfs)(int);
static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real_creat)(const char *, mode_t);
static int (*real_creat64)(const char *, mode_t);
static int (*real___open_2)(const char *, int);
static int (*real___open64_2)(const char *, int);
static int (*real___openat_2)(int, const char *, int);
static int (*real___openat64_2)(int, const char *, int);
static int (*real_close)(int);
static int (*real_dup2)(int, int);
static int (*real_dup3)(int, int, int);

static char g_dir[PATH_MAX];
static size_t g_dirlen;
static char g_logpath[PATH_MAX];
static int g_enabled;
static int g_inited;

/* The recursion guard: set while this library does its own I/O on this thread.
 * initial-exec, so reading it never calls into the dynamic linker. */
static __thread int g_busy __attribute__((tls_model("initial-exec")));

#define RESOLVE(name) (real_##name = (__typeof__(real_##name))dlsym(RTLD_NEXT, #name))

/* Idempotent: run by the constructor, and again by the first wrapper called
 * before it (another library's constructor may write). No lock: every step
 * stores the same values whichever thread runs it. */
static void init(void)
{
    if (__atomic_load_n(&g_inited, __ATOMIC_ACQUIRE))
        return;
    RESOLVE(write); RESOLVE(pwrite); RESOLVE(pwrite64); RESOLVE(writev);
    RESOLVE(pwritev); RESOLVE(pwritev64); RESOLVE(pwritev2); RESOLVE(pwritev64v2);
    RESOLVE(ftruncate); RESOLVE(ftruncate64); RESOLVE(truncate); RESOLVE(truncate64);
    RESOLVE(fallocate); RESOLVE(fallocate64); RESOLVE(posix_fallocate); RESOLVE(posix_fallocate64);
    RESOLVE(fsync); RESOLVE(fdatasync); RESOLVE(sync); RESOLVE(syncfs);
    RESOLVE(open); RESOLVE(open64); RESOLVE(openat); RESOLVE(openat64);
    RESOLVE(creat); RESOLVE(creat64); RESOLVE(__open_2); RESOLVE(__open64_2);
    RESOLVE(__openat_2); RESOLVE(__openat64_2);
    RESOLVE(close); RESOLVE(dup2); RESOLVE(dup3);
    const char *dir = getenv("AGCK_POWERCUT_DIR");
    const char *log = getenv("AGCK_POWERCUT_LOG");
    int on = 0;
    if (dir && dir[0] == '/' && log && log[0] == '/' && strlen(log) < sizeof g_logpath
        && realpath(dir, g_dir) != NULL) {
        strcpy(g_logpath, log);
        /* "/" tracks everything: match on the slash that follows the prefix */
        g_dirlen = strcmp(g_dir, "/") == 0 ? 0 : strlen(g_dir);
        on = 1;
    }
    g_enabled = on;
    __atomic_store_n(&g_inited, 1, __ATOMIC_RELEASE);
}

__attribute__((constructor)) static void ctor(void) { init(); }

/* True when this call should be examined: configured, and not our own I/O. */
static int active(void)
{
    init();
    return g_enabled && !g_busy;
}

static void die(const char *msg)
{
    /* A record that cannot be appended would make the harness silently lenient:
     * stop the program loudly instead. */
    static const char pre[] = "agck powercut: ";
    real_write(2, pre, sizeof pre - 1);
    real_write(2, msg, strlen(msg));
    real_write(2, "\n", 1);
    abort();
}

/* ---- which files are tracked --------------------------------------------------- */

/* "/proc/self/fd/N" without snprintf, which is not async-signal-safe. */
static void fd_link(int fd, char out[32])
{
    static const char p[] = "/proc/self/fd/";
    char digits[12];
    int n = 0;
    unsigned v = (unsigned)fd;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    memcpy(out, p, sizeof p - 1);
    char *q = out + sizeof p - 1;
    while (n)
        *q++ = digits[--n];
    *q = '\0';
}

static int under_dir(const char *p)
{
    return strncmp(p, g_dir, g_dirlen) == 0 && (p[g_dirlen] == '\0' || p[g_dirlen] == '/');
}

/* The canonical path an fd refers to; -1 when it has none. */
static ssize_t fd_path(int fd, char *out, size_t cap)
{
    char link[32];
    fd_link(fd, link);
    ssize_t n = readlink(link, out, cap - 1);
    if (n <= 0 || out[0] != '/')
        return -1;
    out[n] = '\0';
    return n;
}

/* The per-fd cache: an identity hash of the fd's (dev, ino) in the high 62 bits,
 * the verdict in the low 2 (1 tracked, 2 not). One atomic word per fd, so no lock
 * (fork-safe) and no torn entry; a stale entry of a reused fd number fails the
 * identity check (and close/dup2/dup3 clear theirs). */
#define CACHE_FDS 65536
static uint64_t g_cache[CACHE_FDS];

static uint64_t ident(const struct stat *st)
{
    uint64_t h = ((uint64_t)st->st_ino * 0x9E3779B97F4A7C15ull)
               ^ (((uint64_t)st->st_dev + 0x632BE59BD9B4E019ull) * 0xC2B2AE3D27D4EB4Full);
    return h << 2;
}

static void cache_clear(int fd)
{
    if (fd >= 0 && fd < CACHE_FDS)
        __atomic_store_n(&g_cache[fd], 0, __ATOMIC_RELAXED);
}

static int fd_tracked(int fd, const struct stat *st)
{
    uint64_t key = ident(st);
    if (fd >= 0 && fd < CACHE_FDS) {
        uint64_t c = __atomic_load_n(&g_cache[fd], __ATOMIC_RELAXED);
        if (c && (c & ~3ull) == key)
            return (c & 3) == 1;
    }
    char path[PATH_MAX];
    int yes = fd_path(fd, path, sizeof path) > 0 && under_dir(path);
    if (fd >= 0 && fd < CACHE_FDS)
        __atomic_store_n(&g_cache[fd], key | (yes ? 1u : 2u), __ATOMIC_RELAXED);
    return yes;
}

/* ---- the log ------------------------------------------------------------------------ */

static int g_logfd = -1;
static dev_t g_logdev;
static ino_t g_logino;
static uint64_t g_seq;

/* The log fd of this process, opened lazily. O_CLOEXEC: an exec'd image loads
 * this library afresh and opens its own, so none leaks into it. A forked child
 * shares the parent's (O_APPEND keeps their records whole). Moved to a high
 * number, out of the way of programs that manage low fds; checked by identity
 * before each use, since a program may close every fd or reuse the number. */
static int log_fd(void)
{
    int fd = __atomic_load_n(&g_logfd, __ATOMIC_ACQUIRE);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == g_logdev && st.st_ino == g_logino)
        return fd;
    int nfd = real_open(g_logpath, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (nfd < 0)
        return -1;
    int hi = fcntl(nfd, F_DUPFD_CLOEXEC, 900);
    if (hi >= 0) {
        real_close(nfd);
        nfd = hi;
    }
    if (fstat(nfd, &st) != 0) {
        real_close(nfd);
        return -1;
    }
    if (st.st_size == 0) {
        /* powercut.env() writes the header; a log made without it gets it here */
        static const char hdr[8] = {'A', 'G', 'C', 'K', 'P', 'C', VERSION, '\n'};
        if (real_write(nfd, hdr, sizeof hdr) != (ssize_t)sizeof hdr)
            die("cannot write the log header");
    }
    g_logdev = st.st_dev;
    g_logino = st.st_ino;
    __atomic_store_n(&g_logfd, nfd, __ATOMIC_RELEASE);
    return nfd;
}

/* Append one record: head, the body parts in iov[1..n-2], trailer, in one writev. */
static void emit(struct iovec *iov, int n, struct head *h, uint64_t *trail)
{
    uint64_t total = 0;
    for (int i = 0; i < n; i++)
        total += iov[i].iov_len;
    h->len = total;
    *trail = total ^ TRAIL_XOR;
    int fd = log_fd();
    if (fd < 0)
        die("cannot open AGCK_POWERCUT_LOG");
    ssize_t w = real_writev(fd, iov, n);
    if (w != (ssize_t)total)
        die("short write to AGCK_POWERCUT_LOG");
}

static void head_init(struct head *h, int type, int flags, uint64_t seq)
{
    memset(h, 0, sizeof *h);
    h->magic = LOG_MAGIC;
    h->type = (uint8_t)type;
    h->flags = (uint8_t)flags;
    h->pid = (uint32_t)getpid();
    h->seq = seq;
}

static uint64_t next_seq(void) { return __atomic_add_fetch(&g_seq, 1, __ATOMIC_RELAXED); }

/* A small fixed record: head, body, trailer. */
static void emit_small(int type, int flags, uint64_t seq, const void *body, size_t blen,
                       const void *extra, size_t elen)
{
    struct head h;
    uint64_t trail;
    head_init(&h, type, flags, seq);
    struct iovec iov[4] = {{&h, sizeof h}, {(void *)body, blen}, {(void *)extra, elen}, {&trail, 8}};
    emit(iov, 4, &h, &trail);
}

static void emit_result(uint64_t seq, int64_t result)
{
    int64_t body[1] = {result};
    emit_small(R_RESULT, 0, seq, body, sizeof body, NULL, 0);
}

/* ---- buffers and reads ------------------------------------------------------------ */

#define STACK_BUF 8192       /* a Postgres page: most pre-images fit on the stack */
#define MAX_PIECES 60        /* data iovecs of one WRITE record; more are gathered */

/* Space for n bytes: the caller's stack buffer when it fits, else anonymous
 * memory (mmap, not malloc: write() may be called from a signal handler). */
static void *buf_get(size_t n, void *stackbuf)
{
    if (n <= STACK_BUF)
        return stackbuf;
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void buf_put(void *p, size_t n, void *stackbuf)
{
    if (p && p != stackbuf)
        munmap(p, n);
}

/* An fd to read the file through: fd itself when it is readable, else a second
 * open of the same file (an O_WRONLY fd cannot be read). *own says to close it. */
static int reader(int fd, int *own)
{
    int fl = fcntl(fd, F_GETFL);
    *own = 0;
    if (fl >= 0 && (fl & O_ACCMODE) != O_WRONLY)
        return fd;
    char link[32];
    fd_link(fd, link);
    int r = real_open(link, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (r >= 0)
        *own = 1;
    return r;
}

/* Read up to n bytes at off; the count read (short at end of file), -1 on error. */
static ssize_t read_at(int fd, void *buf, size_t n, off_t off)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, off + (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* Read [off, off + n) of the file fd refers to into buf; the count read, -1 on error. */
static ssize_t read_old(int fd, void *buf, size_t n, off_t off)
{
    int own;
    int r = reader(fd, &own);
    if (r < 0)
        return -1;
    ssize_t got = read_at(r, buf, n, off);
    if (own) {
        cache_clear(r);
        real_close(r);
    }
    return got;
}

/* The old bytes a record keeps to undo its op (a WRITE's pre-image, a TRUNC's
 * tail): [start, start + *n) of the file fd refers to, whose size is *old.
 * Returns the buffer they were read into (stackbuf when they fit; the caller
 * releases it with buf_put(p, *n, stackbuf)). When they cannot be read: NULL,
 * *n 0 and F_NOPRE added to *flags. When the file shrank under us, *n and *old
 * shrink to where the bytes ended. */
static void *read_undo(int fd, uint64_t start, uint64_t *n, uint64_t *old, int *flags,
                       void *stackbuf)
{
    void *p = buf_get(*n, stackbuf);
    ssize_t got = p ? read_old(fd, p, *n, (off_t)start) : -1;
    if (got < 0) {
        *flags |= F_NOPRE;
        buf_put(p, *n, stackbuf);
        *n = 0;
        return NULL;
    }
    if ((uint64_t)got < *n) {
        *n = (uint64_t)got;
        *old = start + *n;
    }
    return p;
}

static int all_zero(const struct iovec *iov, int cnt)
{
    for (int i = 0; i < cnt; i++) {
        const unsigned char *p = iov[i].iov_base;
        for (size_t j = 0; j < iov[i].iov_len; j++)
            if (p[j])
                return 0;
    }
    return 1;
}

/* ---- WRITE ------------------------------------------------------------------------------ */

struct pending {
    int on;             /* a WRITE record was appended: finish_write has work to do */
    int locked;         /* an append: holds the append lock until the write is done */
    uint64_t seq;
    uint64_t len;
};

/* Appends are serialized, across every shimmed process, from the fstat that
 * gives their offset (the end of the file) until the write has landed there, so
 * the offset logged is where the data went even when processes append to one
 * file at once (through one shared file description, after fork, too). Two
 * levels: a word for the threads of this process, holding the pid of the process
 * whose thread has it (after fork a child finds its parent's pid there: held by
 * no thread of its own, so free to take), and an OFD lock on the log through a
 * description this process opened itself (a forked child must not share its
 * parent's: OFD locks belong to descriptions). */
static int g_applock;
static __thread int g_holding __attribute__((tls_model("initial-exec")));
static int g_lockfd = -1;
static int g_lockpid;

static void append_lock(void)
{
    int me = getpid();
    for (;;) {
        int cur = 0;
        if (__atomic_compare_exchange_n(&g_applock, &cur, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            break;
        if (cur != me && __atomic_compare_exchange_n(&g_applock, &cur, me, 0, __ATOMIC_ACQUIRE,
                                                     __ATOMIC_RELAXED))
            break;
        sched_yield();
    }
    g_holding = 1;
    if (g_lockpid != me) {
        if (g_lockfd >= 0)
            real_close(g_lockfd);   /* the parent's description: dropping our reference never unlocks it */
        int fd = real_open(g_logpath, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            die("cannot open AGCK_POWERCUT_LOG to lock it");
        int hi = fcntl(fd, F_DUPFD_CLOEXEC, 900);
        if (hi >= 0) {
            real_close(fd);
            fd = hi;
        }
        g_lockfd = fd;
        g_lockpid = me;
    }
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    while (fcntl(g_lockfd, F_OFD_SETLKW, &fl) != 0)
        if (errno != EINTR)
            die("cannot lock AGCK_POWERCUT_LOG");
}

static void append_unlock(void)
{
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    fcntl(g_lockfd, F_OFD_SETLK, &fl);
    g_holding = 0;
    __atomic_store_n(&g_applock, 0, __ATOMIC_RELEASE);
}

/* Append WRITE for [off, off + len) of the file st describes, with the data in
 * iov (NULL: zeros). */
static uint64_t log_write(int fd, const struct stat *st, int64_t off, const struct iovec *iov,
                          int cnt, uint64_t len, int flags)
{
    char stackbuf[STACK_BUF];
    uint64_t old = (uint64_t)st->st_size;
    uint64_t prelen = (uint64_t)off < old ? (old - (uint64_t)off < len ? old - (uint64_t)off : len) : 0;
    void *pre = prelen ? read_undo(fd, (uint64_t)off, &prelen, &old, &flags, stackbuf) : NULL;
    if (iov == NULL || (len >= 4096 && all_zero(iov, cnt)))
        flags |= F_ZEROS;
    uint64_t seq = next_seq();
    struct head h;
    uint64_t trail;
    head_init(&h, R_WRITE, flags, seq);
    uint64_t body[6] = {(uint64_t)st->st_dev, (uint64_t)st->st_ino, (uint64_t)off, len, old, prelen};
    int data_iovs = (flags & F_ZEROS) ? 0 : cnt;
    void *gather = NULL;
    if (data_iovs > MAX_PIECES) {
        /* more pieces than the record's iovec array holds: gather them into one
         * buffer (mmap: this may run in a signal handler) */
        gather = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (gather == MAP_FAILED)
            die("cannot gather a writev of many pieces");
        size_t at = 0;
        for (int i = 0; i < cnt; i++) {
            memcpy((char *)gather + at, iov[i].iov_base, iov[i].iov_len);
            at += iov[i].iov_len;
        }
    }
    struct iovec small[MAX_PIECES + 4];
    int n = 0;
    small[n++] = (struct iovec){&h, sizeof h};
    small[n++] = (struct iovec){body, sizeof body};
    small[n++] = (struct iovec){pre, prelen};
    if (gather)
        small[n++] = (struct iovec){gather, len};
    else
        for (int i = 0; i < data_iovs; i++)
            small[n++] = iov[i];
    small[n++] = (struct iovec){&trail, 8};
    emit(small, n, &h, &trail);
    if (gather)
        munmap(gather, len);
    buf_put(pre, prelen, stackbuf);
    return seq;
}

/* Before a write of iov to fd at off (-1: at the file position; rwf: pwritev2's
 * flags). Sets p->on when a WRITE record was appended and p must be finished. */
static void begin_write(int fd, const struct iovec *iov, int cnt, int64_t off, int rwf,
                        struct pending *p)
{
    p->on = 0;
    /* g_holding: a signal handler writing while this thread holds the append
     * lock; waiting for it here would wait for ourselves */
    if (!active() || cnt < 0 || g_holding)
        return;
    uint64_t len = 0;
    for (int i = 0; i < cnt; i++)
        len += iov[i].iov_len;
    if (len == 0)
        return;
    int saved = errno;
    struct stat st;
    g_busy = 1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && fd_tracked(fd, &st)) {
        int fl = fcntl(fd, F_GETFL);
        /* Linux appends with O_APPEND even for pwrite, whatever its offset */
        int append = (fl >= 0 && (fl & O_APPEND)) || (rwf & RWF_APPEND);
        if (append) {
            append_lock();
            if (fstat(fd, &st) != 0)
                st.st_size = 0;
        }
        int64_t o = append ? (int64_t)st.st_size : off >= 0 ? off : (int64_t)lseek(fd, 0, SEEK_CUR);
        if (o >= 0) {
            int flags = ((fl >= 0 && (fl & O_DSYNC)) || (rwf & (RWF_DSYNC | RWF_SYNC))) ? F_SYNCIO : 0;
            p->seq = log_write(fd, &st, o, iov, cnt, len, flags);
            p->len = len;
            p->locked = append;
            p->on = 1;
        } else if (append) {
            append_unlock();
        }
    }
    g_busy = 0;
    errno = saved;
}

/* After the real write returned r: a RESULT when it did not do what was logged.
 * Returns r. */
static ssize_t finish_write(const struct pending *p, ssize_t r)
{
    if (!p->on)
        return r;
    int saved = errno;
    g_busy = 1;
    if (r < 0 || (uint64_t)r != p->len)
        emit_result(p->seq, r < 0 ? -1 : r);
    if (p->locked)
        append_unlock();
    g_busy = 0;
    errno = saved;
    return r;
}

/* The wrappers. Each interposed libc symbol gets its own exported function, since
 * a program may call any of them (its headers pick pwrite or pwrite64, open64
 * under _FILE_OFFSET_BITS=64, __open_2 under _FORTIFY_SOURCE) and each must
 * reach its own real_ function. Every one calls init() first (another library's
 * constructor may call it before ours ran), then the steps its family shares:
 * a WRAP_ macro around `call`, the real function's call, for writes and opens;
 * a begin_ helper and finish_op or note_sync for size changes and syncs. */

/* WRAP_WRITE(fd, iov, cnt, off, rwf, call): ends a write wrapper. Appends the
 * WRITE of the cnt pieces of iov at off (-1: at the file position; rwf:
 * pwritev2's flags) before `call`, and its RESULT after it when `call` did not
 * write them all; returns what `call` returned. */
#define WRAP_WRITE(fd, iov, cnt, off, rwf, call)         \
    do {                                                 \
        struct pending p_;                               \
        begin_write(fd, iov, cnt, off, rwf, &p_);        \
        return finish_write(&p_, call);                  \
    } while (0)

/* WRAP_PWRITE(fd, iov, cnt, off, min_off, rwf, call): WRAP_WRITE for a write at
 * an offset. An offset below min_off is invalid: it goes straight to `call`,
 * which refuses it, and nothing is logged. */
#define WRAP_PWRITE(fd, iov, cnt, off, min_off, rwf, call) \
    do {                                                   \
        if ((off) < (min_off))                             \
            return call;                                   \
        WRAP_WRITE(fd, iov, cnt, off, rwf, call);          \
    } while (0)

/* What pwritev2 and pwritev64v2 do when the libc lacks them (older than 2.26). */
static ssize_t no_such_call(void)
{
    errno = ENOSYS;
    return -1;
}

ssize_t write(int fd, const void *buf, size_t n)
{
    init();
    struct iovec v = {(void *)buf, n};
    WRAP_WRITE(fd, &v, 1, -1, 0, real_write(fd, buf, n));
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    init();
    struct iovec v = {(void *)buf, n};
    WRAP_PWRITE(fd, &v, 1, off, 0, 0, real_pwrite(fd, buf, n, off));
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off)
{
    init();
    struct iovec v = {(void *)buf, n};
    WRAP_PWRITE(fd, &v, 1, off, 0, 0, real_pwrite64(fd, buf, n, off));
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    init();
    WRAP_WRITE(fd, iov, cnt, -1, 0, real_writev(fd, iov, cnt));
}

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off)
{
    init();
    WRAP_PWRITE(fd, iov, cnt, off, 0, 0, real_pwritev(fd, iov, cnt, off));
}

ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off64_t off)
{
    init();
    WRAP_PWRITE(fd, iov, cnt, off, 0, 0, real_pwritev64(fd, iov, cnt, off));
}

/* pwritev2 with offset -1 writes at (and moves) the file position */
ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags)
{
    init();
    if (!real_pwritev2)
        return no_such_call();
    WRAP_PWRITE(fd, iov, cnt, off, -1, flags, real_pwritev2(fd, iov, cnt, off, flags));
}

ssize_t pwritev64v2(int fd, const struct iovec *iov, int cnt, off64_t off, int flags)
{
    init();
    if (!real_pwritev64v2)
        return no_such_call();
    WRAP_PWRITE(fd, iov, cnt, off, -1, flags, real_pwritev64v2(fd, iov, cnt, off, flags));
}

/* ---- TRUNC ------------------------------------------------------------------------------ */

/* Append TRUNC of the file st describes (read through fd) from its size to size;
 * returns its seq, or 0 when there is nothing to record. */
static uint64_t log_trunc(int fd, const struct stat *st, uint64_t size)
{
    uint64_t old = (uint64_t)st->st_size;
    if (size == old)
        return 0;
    char stackbuf[STACK_BUF];
    int flags = 0;
    uint64_t tlen = size < old ? old - size : 0;
    void *tail = tlen ? read_undo(fd, size, &tlen, &old, &flags, stackbuf) : NULL;
    uint64_t seq = next_seq();
    uint64_t body[5] = {(uint64_t)st->st_dev, (uint64_t)st->st_ino, old, size, tlen};
    emit_small(R_TRUNC, flags, seq, body, sizeof body, tail, tlen);
    buf_put(tail, tlen, stackbuf);
    return seq;
}

/* Before a size change of fd to size (grow_only: fallocate, which never shrinks).
 * Returns the seq of the TRUNC appended, 0 if none. */
static uint64_t begin_trunc(int fd, int64_t size, int grow_only)
{
    if (!active() || size < 0)
        return 0;
    int saved = errno;
    uint64_t seq = 0;
    struct stat st;
    g_busy = 1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && fd_tracked(fd, &st)
        && (!grow_only || size > st.st_size))
        seq = log_trunc(fd, &st, (uint64_t)size);
    g_busy = 0;
    errno = saved;
    return seq;
}

/* The same for a path (truncate, open with O_TRUNC); nofollow: O_NOFOLLOW. */
static uint64_t begin_trunc_path(int dirfd, const char *path, int64_t size, int nofollow)
{
    if (!active() || size < 0 || path == NULL)
        return 0;
    int saved = errno;
    uint64_t seq = 0;
    struct stat st;
    g_busy = 1;
    /* stat first: opening a FIFO or a device to look at it could block or act */
    if (fstatat(dirfd, path, &st, nofollow ? AT_SYMLINK_NOFOLLOW : 0) == 0 && S_ISREG(st.st_mode)
        && (uint64_t)size != (uint64_t)st.st_size) {
        int fd = real_openat(dirfd, path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | (nofollow ? O_NOFOLLOW : 0));
        if (fd >= 0) {
            char p[PATH_MAX];
            if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && fd_path(fd, p, sizeof p) > 0 && under_dir(p))
                seq = log_trunc(fd, &st, (uint64_t)size);
            real_close(fd);
        } else {
            /* unreadable: record the size change without the tail (NOPRE) */
            char p[PATH_MAX];
            if (realpath(path, p) && under_dir(p) && dirfd == AT_FDCWD) {
                uint64_t old = (uint64_t)st.st_size;
                uint64_t body[5] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino, old, (uint64_t)size, 0};
                seq = next_seq();
                emit_small(R_TRUNC, (uint64_t)size < old ? F_NOPRE : 0, seq, body, sizeof body, NULL, 0);
            }
        }
    }
    g_busy = 0;
    errno = saved;
    return seq;
}

/* After a size change (or an open that truncated) returned r: a RESULT of -1
 * for the record seq (0: none was appended) when it failed, r nonzero. Returns r.
 * The size-change wrappers below append their record with begin_trunc,
 * begin_trunc_path or begin_fallocate before the real call and hand its result
 * to this. */
static int finish_op(uint64_t seq, int r)
{
    if (!seq || r == 0)
        return r;
    int saved = errno;
    g_busy = 1;
    emit_result(seq, -1);
    g_busy = 0;
    errno = saved;
    return r;
}

int ftruncate(int fd, off_t len)
{
    init();
    uint64_t s = begin_trunc(fd, len, 0);
    return finish_op(s, real_ftruncate(fd, len));
}

int ftruncate64(int fd, off64_t len)
{
    init();
    uint64_t s = begin_trunc(fd, len, 0);
    return finish_op(s, real_ftruncate64(fd, len));
}

int truncate(const char *path, off_t len)
{
    init();
    uint64_t s = begin_trunc_path(AT_FDCWD, path, len, 0);
    return finish_op(s, real_truncate(path, len));
}

int truncate64(const char *path, off64_t len)
{
    init();
    uint64_t s = begin_trunc_path(AT_FDCWD, path, len, 0);
    return finish_op(s, real_truncate64(path, len));
}

int posix_fallocate(int fd, off_t off, off_t len)
{
    init();
    uint64_t s = off >= 0 && len > 0 ? begin_trunc(fd, off + len, 1) : 0;
    return finish_op(s, real_posix_fallocate(fd, off, len));
}

int posix_fallocate64(int fd, off64_t off, off64_t len)
{
    init();
    uint64_t s = off >= 0 && len > 0 ? begin_trunc(fd, off + len, 1) : 0;
    return finish_op(s, real_posix_fallocate64(fd, off, len));
}

/* Before fallocate: a plain allocation past the end is a size change; punching
 * a hole or zeroing a range is a write of zeros. */
static uint64_t begin_fallocate(int fd, int mode, int64_t off, int64_t len)
{
    if (!active() || off < 0 || len <= 0)
        return 0;
    int keep = mode & FALLOC_FL_KEEP_SIZE;
    int rest = mode & ~FALLOC_FL_KEEP_SIZE;
    if (rest == 0)
        return keep ? 0 : begin_trunc(fd, off + len, 1);
    if (rest != FALLOC_FL_PUNCH_HOLE && rest != FALLOC_FL_ZERO_RANGE)
        return 0;
    int saved = errno;
    uint64_t seq = 0;
    struct stat st;
    g_busy = 1;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && fd_tracked(fd, &st)) {
        int64_t end = off + len;
        if (keep && end > st.st_size)
            end = st.st_size;
        if (end > off)
            seq = log_write(fd, &st, off, NULL, 0, (uint64_t)(end - off), F_ZEROS);
    }
    g_busy = 0;
    errno = saved;
    return seq;
}

int fallocate(int fd, int mode, off_t off, off_t len)
{
    init();
    uint64_t s = begin_fallocate(fd, mode, off, len);
    return finish_op(s, real_fallocate(fd, mode, off, len));
}

int fallocate64(int fd, int mode, off64_t off, off64_t len)
{
    init();
    uint64_t s = begin_fallocate(fd, mode, off, len);
    return finish_op(s, real_fallocate64(fd, mode, off, len));
}

/* ---- SYNC ------------------------------------------------------------------------------- */

/* After fsync or fdatasync of fd returned r: a SYNC when it succeeded (r 0) and fd
 * is a tracked file or directory. Returns r. */
static int note_sync(int fd, int r)
{
    if (r != 0 || !active())
        return r;
    int saved = errno;
    struct stat st;
    g_busy = 1;
    if (fstat(fd, &st) == 0 && (S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)) && fd_tracked(fd, &st)) {
        uint64_t body[2] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino};
        emit_small(R_SYNC, 0, next_seq(), body, sizeof body, NULL, 0);
    }
    g_busy = 0;
    errno = saved;
    return r;
}

int fsync(int fd)
{
    init();
    return note_sync(fd, real_fsync(fd));
}

int fdatasync(int fd)
{
    init();
    return note_sync(fd, real_fdatasync(fd));
}

void sync(void)
{
    init();
    real_sync();
    if (active()) {
        int saved = errno;
        uint64_t body[1] = {0};
        g_busy = 1;
        emit_small(R_SYNCFS, F_ALL, next_seq(), body, sizeof body, NULL, 0);
        g_busy = 0;
        errno = saved;
    }
}

int syncfs(int fd)
{
    init();
    int r = real_syncfs(fd);
    struct stat st;
    if (r == 0 && active()) {
        int saved = errno;
        g_busy = 1;
        if (fstat(fd, &st) == 0) {
            uint64_t body[1] = {(uint64_t)st.st_dev};
            emit_small(R_SYNCFS, 0, next_seq(), body, sizeof body, NULL, 0);
        }
        g_busy = 0;
        errno = saved;
    }
    return r;
}

/* ---- CREATE (and O_TRUNC) ------------------------------------------------------------ */

struct opening {
    int on;             /* flags create or truncate: finish_open has work to do */
    int will_create;
    uint64_t trunc_seq;
};

/* Before an open of path (relative to dirfd) with flags: a TRUNC when O_TRUNC
 * will empty a file, and a note in o of whether the open will create one. */
static void begin_open(int dirfd, const char *path, int flags, struct opening *o)
{
    o->on = 0;
    o->trunc_seq = 0;
    o->will_create = 0;
    if (!active() || path == NULL || (flags & O_TMPFILE) == O_TMPFILE || !(flags & (O_CREAT | O_TRUNC)))
        return;
    int saved = errno;
    int nofollow = (flags & O_NOFOLLOW) != 0;
    struct stat st;
    g_busy = 1;
    int exists = fstatat(dirfd, path, &st, nofollow ? AT_SYMLINK_NOFOLLOW : 0) == 0;
    g_busy = 0;
    if (flags & O_CREAT)
        o->will_create = (flags & O_EXCL) || (!exists && errno == ENOENT);
    if ((flags & O_TRUNC) && exists && S_ISREG(st.st_mode) && st.st_size > 0 && !(flags & O_EXCL))
        o->trunc_seq = begin_trunc_path(dirfd, path, 0, nofollow);
    errno = saved;
    o->on = 1;
}

/* After the real open returned fd: the TRUNC's RESULT when it failed, the CREATE
 * of the file when it made one. Returns fd. */
static int finish_open(const struct opening *o, int fd)
{
    if (!o->on)
        return fd;
    if (fd < 0)
        return finish_op(o->trunc_seq, fd);
    if (!o->will_create)
        return fd;
    int saved = errno;
    struct stat st, pst;
    char path[PATH_MAX];
    g_busy = 1;
    ssize_t n;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (n = fd_path(fd, path, sizeof path)) > 0
        && under_dir(path) && fd_tracked(fd, &st)) {
        char *slash = strrchr(path, '/');
        char save = slash[1];
        slash[1] = '\0';          /* the parent, keeping "/" for a file at the root */
        int ok = stat(path, &pst) == 0;
        slash[1] = save;
        if (ok) {
            uint64_t body[5] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino, (uint64_t)pst.st_dev,
                                (uint64_t)pst.st_ino, (uint64_t)n};
            emit_small(R_CREATE, 0, next_seq(), body, sizeof body, path, (size_t)n);
        }
    }
    g_busy = 0;
    errno = saved;
    return fd;
}

/* WRAP_OPEN(dirfd, path, flags, call): ends an open wrapper (see "The wrappers"
 * under WRITE). begin_open and finish_open around `call`, the real open of path
 * (relative to dirfd) with flags; returns the fd `call` returned. */
#define WRAP_OPEN(dirfd, path, flags, call)          \
    do {                                             \
        struct opening o_;                           \
        begin_open(dirfd, path, flags, &o_);         \
        return finish_open(&o_, call);               \
    } while (0)

/* VA_MODE(flags): the mode argument of a variadic open, read only when flags say
 * it was passed. A macro, as va_start must run in the wrapper itself. */
#define VA_MODE(flags)                                                    \
    __extension__({                                                       \
        va_list ap_;                                                      \
        va_start(ap_, flags);                                             \
        mode_t m_ = NEEDS_MODE(flags) ? (mode_t)va_arg(ap_, int) : 0;     \
        va_end(ap_);                                                      \
        m_;                                                               \
    })

int open(const char *path, int flags, ...)
{
    init();
    mode_t mode = VA_MODE(flags);
    WRAP_OPEN(AT_FDCWD, path, flags, real_open(path, flags, mode));
}

int open64(const char *path, int flags, ...)
{
    init();
    mode_t mode = VA_MODE(flags);
    WRAP_OPEN(AT_FDCWD, path, flags, real_open64(path, flags, mode));
}

int openat(int dirfd, const char *path, int flags, ...)
{
    init();
    mode_t mode = VA_MODE(flags);
    WRAP_OPEN(dirfd, path, flags, real_openat(dirfd, path, flags, mode));
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    init();
    mode_t mode = VA_MODE(flags);
    WRAP_OPEN(dirfd, path, flags, real_openat64(dirfd, path, flags, mode));
}

int creat(const char *path, mode_t mode)
{
    init();
    WRAP_OPEN(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, real_creat(path, mode));
}

int creat64(const char *path, mode_t mode)
{
    init();
    WRAP_OPEN(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, real_creat64(path, mode));
}

/* The _FORTIFY_SOURCE entry points take no mode (they refuse O_CREAT without one). */
int __open_2(const char *path, int flags)
{
    init();
    WRAP_OPEN(AT_FDCWD, path, flags, real___open_2(path, flags));
}

int __open64_2(const char *path, int flags)
{
    init();
    WRAP_OPEN(AT_FDCWD, path, flags, real___open64_2(path, flags));
}

int __openat_2(int dirfd, const char *path, int flags)
{
    init();
    WRAP_OPEN(dirfd, path, flags, real___openat_2(dirfd, path, flags));
}

int __openat64_2(int dirfd, const char *path, int flags)
{
    init();
    WRAP_OPEN(dirfd, path, flags, real___openat64_2(dirfd, path, flags));
}

/* ---- fd lifetime: keep the cache and the log fd honest -------------------------------------- */

static void forget_fd(int fd)
{
    cache_clear(fd);
    if (fd == g_lockfd)
        g_lockpid = 0;      /* reopen the lock's description next time */
    int cur = fd;
    /* the program closed (or replaced) our log fd: open a new one next time */
    __atomic_compare_exchange_n(&g_logfd, &cur, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

int close(int fd)
{
    init();
    forget_fd(fd);
    return real_close(fd);
}

int dup2(int oldfd, int newfd)
{
    init();
    if (oldfd != newfd)
        forget_fd(newfd);
    return real_dup2(oldfd, newfd);
}

int dup3(int oldfd, int newfd, int flags)
{
    init();
    forget_fd(newfd);
    return real_dup3(oldfd, newfd, flags);
}
