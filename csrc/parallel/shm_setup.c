/*
 * shm_setup.c — the shared segment's life: creating, joining, naming, and cleaning up.
 *
 * The name in /dev/shm exists only while ranks join. Rank 0 makes the file complete (sized,
 * reserved, header written) before it gets a name (O_TMPFILE, then linkat through /proc), so a
 * named file always has a header saying who created it; the last rank to join removes the name.
 * A name can outlive set-up only if ranks die during it: the ranks still alive remove it when
 * they see a creator or joined peer dead (checked every ~50 ms) or time out, and when nobody is
 * left, the next set-up on this machine removes it (rank 0 sweeps names starting with "llmmem-"
 * whose creator process is dead). Waiting here is polled like the collectives' waits (see
 * llmmem_comm_set_wait_poll), so Ctrl-C is not held up for the whole timeout.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shm_internal.h"

#define SWEEP_PREFIX "llmmem-"

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "/dev/shm/%s", name); }

static void unmap(llmmem_shm_comm_t *c) {
  if (c->base) munmap(c->base, c->total_bytes);
  c->base = NULL;
}

/* 1 when `pid` (of PID namespace `ns`) is known to be dead to this process. */
static int dead_in_our_namespace(int pid, uint64_t ns) {
  return _llmmem_shm_dead_in_namespace(pid, ns, _llmmem_shm_pid_namespace());
}

/* Removes the names of our segments (prefix, owner, magic, version) whose creator is dead: left
 * behind when every rank of a job died during set-up. Only names are removed: a process that
 * still maps such a segment keeps its mapping. Best effort: any doubt keeps the file. */
static void sweep_stale_segments(void) {
  DIR *dir = opendir("/dev/shm");
  if (!dir) return;
  const uid_t me = geteuid();
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    if (strncmp(e->d_name, SWEEP_PREFIX, sizeof SWEEP_PREFIX - 1) != 0) continue;
    int fd = openat(dirfd(dir), e->d_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat st;
    shm_header_t h;
    int stale = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == me && (size_t)st.st_size >= sizeof h &&
                pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h && atomic_load(&h.magic) == LLMMEM_SHM_MAGIC &&
                h.version == LLMMEM_SHM_VERSION && dead_in_our_namespace(h.creator_pid, h.creator_pid_ns);
    close(fd);
    if (stale) (void)unlinkat(dirfd(dir), e->d_name, 0);
  }
  closedir(dir);
}

/* Sizes, reserves, maps and initialises the file `fd`; publishes the header with the magic. */
static llmmem_status_t fill_segment(llmmem_shm_comm_t *c, int fd, const char *path) {
  int err = ftruncate(fd, (off_t)c->total_bytes) != 0 ? errno : posix_fallocate(fd, 0, (off_t)c->total_bytes);
  if (err != 0)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: cannot reserve %zu bytes in %s: %s", c->total_bytes,
                       path, strerror(err));
  void *p = mmap(NULL, c->total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: mmap of %zu bytes failed: %s", c->total_bytes,
                       strerror(errno));
  c->base = p;
  shm_header_t *h = (shm_header_t *)c->base;
  h->version = LLMMEM_SHM_VERSION;
  h->world_size = c->world_size;
  h->creator_pid = (int32_t)getpid();
  h->creator_pid_ns = _llmmem_shm_pid_namespace();
  h->slot_bytes = c->slot_bytes;
  h->total_bytes = c->total_bytes;
  atomic_store_explicit(&h->magic, LLMMEM_SHM_MAGIC, memory_order_release);
  return LLMMEM_OK;
}

/* Rank 0: a complete segment under `path`. Unnamed first (O_TMPFILE) and linked once complete,
 * so no crash can leave a named file without a header; where the kernel or /proc does not allow
 * that, it is created under its name directly (and a crash in these microseconds could leave a
 * headerless file that no sweep recognises). */
static llmmem_status_t create_segment(llmmem_shm_comm_t *c, const char *path) {
  for (int unnamed = 1; unnamed >= 0; unnamed--) {
    int fd = -1;
#ifdef O_TMPFILE
    if (unnamed) fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
#endif
    if (unnamed && fd < 0) continue;
    if (!unnamed) {
      fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0)
        return LLMMEM_FAIL(errno == EEXIST ? LLMMEM_ERR_STATE : LLMMEM_ERR_NOMEM,
                           "llmmem_shm_comm_open: cannot create %s: %s", path, strerror(errno));
    }
    llmmem_status_t st = fill_segment(c, fd, path);
    if (st == LLMMEM_OK && unnamed) {
      char self[64];
      snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
      if (linkat(AT_FDCWD, self, AT_FDCWD, path, AT_SYMLINK_FOLLOW) != 0) {
        int err = errno;
        close(fd);
        unmap(c);
        if (err == EEXIST)
          return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_shm_comm_open: cannot create %s: %s", path, strerror(err));
        continue; /* no /proc (or no linkat on this fs): name it up front instead */
      }
    }
    close(fd);
    if (st != LLMMEM_OK) {
      unmap(c);
      if (!unnamed) unlink(path);
    }
    return st;
  }
  return LLMMEM_FAIL(LLMMEM_ERR_INTERNAL, "llmmem_shm_comm_open: no way to create %s (please report)", path);
}

/* Other ranks: wait for the segment to exist and be published, check it, map it whole. */
static llmmem_status_t attach_segment(llmmem_shm_comm_t *c, const char *path, double deadline) {
  double next_check = 0;
  for (;;) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
      struct stat st;
      if (fstat(fd, &st) == 0 && (size_t)st.st_size >= LLMMEM_SHM_HEADER_BYTES) {
        shm_header_t *h = mmap(NULL, LLMMEM_SHM_HEADER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (h == MAP_FAILED) {
          close(fd);
          return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: mmap of %s failed: %s", path, strerror(errno));
        }
        if (atomic_load_explicit(&h->magic, memory_order_acquire) == LLMMEM_SHM_MAGIC) {
          int ws = h->world_size, creator = h->creator_pid;
          uint64_t creator_ns = h->creator_pid_ns;
          uint32_t ver = h->version;
          size_t slot = h->slot_bytes, total = h->total_bytes;
          munmap(h, LLMMEM_SHM_HEADER_BYTES);
          if (ver != LLMMEM_SHM_VERSION || ws != c->world_size || (size_t)st.st_size < total) {
            close(fd);
            return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                               "llmmem_shm_comm_open: segment %s was made for world size %d (version %u), this "
                               "rank expects %d (version %u)",
                               path, ws, ver, c->world_size, LLMMEM_SHM_VERSION);
          }
          if (dead_in_our_namespace(creator, creator_ns)) {
            close(fd);
            unlink(path); /* nobody else will: the set-up cannot succeed */
            return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                               "llmmem_shm_comm_open: rank 0 (pid %d), which created segment %s, exited before "
                               "every rank joined",
                               creator, path);
          }
          void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          close(fd);
          if (p == MAP_FAILED)
            return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: mmap of %zu bytes failed: %s", total,
                               strerror(errno));
          c->base = p;
          c->slot_bytes = slot;
          c->total_bytes = total;
          return LLMMEM_OK;
        }
        munmap(h, LLMMEM_SHM_HEADER_BYTES);
      }
      close(fd);
    } else if (errno != ENOENT) {
      return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_shm_comm_open: cannot open %s: %s", path, strerror(errno));
    }
    double t = _llmmem_shm_now();
    if (t > deadline)
      return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                         "llmmem_shm_comm_open: rank %d: segment %s did not appear within %.3g s (is rank 0 on "
                         "this host and does it share /dev/shm?)",
                         c->rank, path, c->timeout_s);
    if (t >= next_check) {
      next_check = t + LLMMEM_SHM_CHECK_PERIOD_S;
      if (_llmmem_shm_poll_says_stop())
        return LLMMEM_FAIL(LLMMEM_ERR_STATE,
                           "llmmem_shm_comm_open: interrupted on rank %d while waiting for "
                           "segment %s to appear",
                           c->rank, path);
    }
    _llmmem_shm_nap_us(500);
  }
}

/* A rank that joined this segment and whose process has died since, or -1. */
static int dead_joined_rank(llmmem_shm_comm_t *c) {
  for (int q = 0; q < c->world_size; q++) {
    if (q == c->rank) continue;
    int pid = c->ctl[q].pid;
    /* our own namespace is in our slot already: no stat() per peer every check period */
    if (pid != 0 && _llmmem_shm_dead_in_namespace(pid, c->ctl[q].pid_ns, c->ctl[c->rank].pid_ns)) return q;
  }
  return -1;
}

/* Everyone waits for everyone: a rank that never joins fails the set-up on all the others. */
static llmmem_status_t wait_for_all(llmmem_shm_comm_t *c, double deadline) {
  double next_check = 0;
  while (atomic_load_explicit(&c->hdr->joined, memory_order_acquire) < c->world_size) {
    if (atomic_load_explicit(&c->hdr->abort_rank, memory_order_acquire)) {
      c->broken = 1;
      return LLMMEM_FAIL(LLMMEM_ERR_STATE, "llmmem_shm_comm_open: another rank gave up: %s", c->hdr->abort_msg);
    }
    double t = _llmmem_shm_now();
    if (t > deadline)
      return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                              "llmmem_shm_comm_open: only %d of %d ranks joined segment %s within "
                              "%.3g s",
                              atomic_load(&c->hdr->joined), c->world_size, c->name, c->timeout_s);
    if (t >= next_check) {
      next_check = t + LLMMEM_SHM_CHECK_PERIOD_S;
      if (_llmmem_shm_poll_says_stop())
        return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                                "llmmem_shm_comm_open: interrupted on rank %d while waiting for "
                                "the other ranks to join segment %s",
                                c->rank, c->name);
      int dead = dead_joined_rank(c);
      if (dead >= 0)
        return _llmmem_shm_fail(c, LLMMEM_ERR_STATE,
                                "llmmem_shm_comm_open: rank %d (pid %d) exited during set-up "
                                "of segment %s",
                                dead, c->ctl[dead].pid, c->name);
    }
    _llmmem_shm_nap_us(200);
  }
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_open(const char *name, int rank, int world_size, size_t slot_bytes, double timeout_s,
                                     llmmem_shm_comm_t **out) {
  LLMMEM_CHECK_ARG(out != NULL, "llmmem_shm_comm_open: out must not be NULL");
  *out = NULL;
  LLMMEM_CHECK_ARG(name != NULL && name[0] != '\0', "llmmem_shm_comm_open: name must be a non-empty string");
  LLMMEM_CHECK_ARG(strlen(name) <= 200 && strchr(name, '/') == NULL,
                   "llmmem_shm_comm_open: name must have at most 200 characters and no '/', got \"%.220s\"", name);
  LLMMEM_CHECK_ARG(world_size >= 1 && world_size <= LLMMEM_SHM_MAX_WORLD,
                   "llmmem_shm_comm_open: world_size must be in 1..%d, got %d", LLMMEM_SHM_MAX_WORLD, world_size);
  LLMMEM_CHECK_ARG(rank >= 0 && rank < world_size, "llmmem_shm_comm_open: rank must be in 0..%d, got %d",
                   world_size - 1, rank);
  LLMMEM_CHECK_ARG(timeout_s > 0, "llmmem_shm_comm_open: timeout_s must be > 0, got %g", timeout_s);
  LLMMEM_CHECK_ARG(slot_bytes <= ((size_t)1 << 32), "llmmem_shm_comm_open: slot_bytes must be <= 4 GiB, got %zu",
                   slot_bytes);
  llmmem_shm_comm_t *c = calloc(1, sizeof *c);
  if (!c) return LLMMEM_FAIL(LLMMEM_ERR_NOMEM, "llmmem_shm_comm_open: out of host memory");
  c->rank = rank;
  c->world_size = world_size;
  c->timeout_s = timeout_s;
  c->slot_bytes = _llmmem_round_up(slot_bytes ? slot_bytes : LLMMEM_SHM_DEFAULT_SLOT, 4096);
  size_t ctl_bytes = _llmmem_round_up((size_t)world_size * LLMMEM_SHM_CTL_BYTES, 4096);
  c->total_bytes = LLMMEM_SHM_HEADER_BYTES + ctl_bytes + (size_t)world_size * 2u * c->slot_bytes;
  snprintf(c->name, sizeof c->name, "%s", name);
  char path[300];
  path_of(path, sizeof path, name);
  double deadline = _llmmem_shm_now() + timeout_s;

  if (rank == 0) sweep_stale_segments();
  llmmem_status_t st = rank == 0 ? create_segment(c, path) : attach_segment(c, path, deadline);
  if (st != LLMMEM_OK) {
    free(c);
    return st;
  }
  c->hdr = (shm_header_t *)c->base;
  c->ctl = (shm_ctl_t *)(c->base + LLMMEM_SHM_HEADER_BYTES);
  c->data = c->base + LLMMEM_SHM_HEADER_BYTES + ctl_bytes;
  c->ctl[rank].pid = (int32_t)getpid();
  c->ctl[rank].pid_ns = _llmmem_shm_pid_namespace();
  /* The name is only needed to join: the last rank to join removes it, so it is gone before any
   * rank can be waiting in a collective (and a crash can no longer leave it behind). */
  if (atomic_fetch_add_explicit(&c->hdr->joined, 1, memory_order_acq_rel) + 1 == world_size) unlink(path);
  st = wait_for_all(c, deadline);
  if (st != LLMMEM_OK) {
    unlink(path);
    unmap(c);
    free(c);
    return st;
  }
  *out = c;
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_close(llmmem_shm_comm_t *comm) {
  if (!comm) return LLMMEM_OK;
  unmap(comm);
  free(comm);
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_set_timeout(llmmem_shm_comm_t *comm, double timeout_s) {
  LLMMEM_CHECK_ARG(comm != NULL, "llmmem_shm_comm_set_timeout: comm must not be NULL");
  LLMMEM_CHECK_ARG(timeout_s > 0, "llmmem_shm_comm_set_timeout: timeout_s must be > 0, got %g", timeout_s);
  comm->timeout_s = timeout_s;
  return LLMMEM_OK;
}

llmmem_status_t llmmem_shm_comm_slot_bytes(const llmmem_shm_comm_t *comm, size_t *out) {
  LLMMEM_CHECK_ARG(comm != NULL && out != NULL, "llmmem_shm_comm_slot_bytes: comm and out must not be NULL");
  *out = comm->slot_bytes;
  return LLMMEM_OK;
}
