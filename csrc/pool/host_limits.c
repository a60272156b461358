/*
 * host_limits.c — how much memory the system can still give this process, and how much address
 * space it may map: what the host backend checks before it commits memory (backend_host.c).
 *
 * Available memory is the least of: MemAvailable + SwapFree (/proc/meminfo: what can be allocated
 * without the kernel running out), the headroom under the memory limit of the process's cgroup
 * (v2: memory.max - memory.current of it and of every ancestor; v1: the hierarchical limit -
 * memory.usage_in_bytes; file cache counted as reclaimable in both), and RLIMIT_DATA - VmData.
 * Reads a handful of small files (tens of microseconds): done only when a pool takes memory from
 * the system, never on an allocation served from memory the pool holds. Where a file cannot be read
 * (not Linux, no cgroup) that bound is left out.
 */
#define _DEFAULT_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "pool_internal.h"

void (*_llmmem_pool_host_probe)(pool_host_limits_t *out) = _llmmem_pool_host_limits;

/* x86-64 with 4-level page tables gives user space 128 TiB (a 5-level kernel maps beyond it only
 * on request); other 64-bit Linux targets give at least as much or fail mmap first. */
#define USER_ADDRESS_SPACE ((size_t)1 << 47)
/* A cgroup limit at or above this means "no limit" (v1 reports one as 2**63 rounded to pages). */
#define NO_LIMIT ((uint64_t)1 << 62)

/* Reads a small text file whole into buf (NUL-terminated). 0, or -1 when it cannot be read. */
static int read_text(const char *path, char *buf, size_t len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t got = 0;
  while (got + 1 < len) {
    ssize_t n = read(fd, buf + got, len - 1 - got);
    if (n < 0) {
      close(fd);
      return -1;
    }
    if (n == 0) break;
    got += (size_t)n;
  }
  close(fd);
  buf[got] = '\0';
  return 0;
}

/* The number after "<name>" at the start of a line of text ("MemAvailable:" in meminfo, "file "
 * in memory.stat). 0, or -1 when absent. */
static int field(const char *text, const char *name, uint64_t *out) {
  const size_t len = strlen(name);
  for (const char *line = text; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
    if (strncmp(line, name, len) != 0) continue;
    char *end;
    unsigned long long v = strtoull(line + len, &end, 10);
    if (end == line + len) return -1;
    *out = (uint64_t)v;
    return 0;
  }
  return -1;
}

/* A file holding one number ("max" reads as no limit). 0, or -1. */
static int number_file(const char *path, uint64_t *out) {
  char buf[64];
  if (read_text(path, buf, sizeof buf) < 0) return -1;
  if (strncmp(buf, "max", 3) == 0) {
    *out = UINT64_MAX;
    return 0;
  }
  char *end;
  unsigned long long v = strtoull(buf, &end, 10);
  if (end == buf) return -1;
  *out = (uint64_t)v;
  return 0;
}

/* The memory cgroup of this process: its directory, and whether it is cgroup v2 (unified).
 * Found once: processes rarely move between cgroups, and moving only makes the bound stale. */
static char cgroup_dir[512];
static int cgroup_v2;
static pthread_once_t cgroup_once = PTHREAD_ONCE_INIT;

static int is_dir_with(const char *dir, const char *file) {
  char path[600];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  return access(path, R_OK) == 0;
}

static void find_cgroup(void) {
  char text[4096];
  cgroup_dir[0] = '\0';
  if (read_text("/proc/self/cgroup", text, sizeof text) < 0) return;
  for (char *line = text; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2) continue;
    char *nl = strchr(c2, '\n');
    const size_t plen = nl ? (size_t)(nl - c2 - 1) : strlen(c2 + 1);
    char rel[400];
    snprintf(rel, sizeof rel, "%.*s", (int)(plen < sizeof rel ? plen : sizeof rel - 1), c2 + 1);
    const size_t clen = (size_t)(c2 - c1 - 1);
    int v1_memory = 0;
    for (const char *p = c1 + 1; p < c2;) { /* the controllers: "memory" among "cpu,memory", say */
      const char *q = memchr(p, ',', (size_t)(c2 - p));
      const size_t n = q ? (size_t)(q - p) : (size_t)(c2 - p);
      if (n == 6 && strncmp(p, "memory", 6) == 0) v1_memory = 1;
      p = q ? q + 1 : c2;
    }
    char dir[512];
    if (clen == 0 && strncmp(line, "0:", 2) == 0) { /* v2; inside a cgroup namespace the mount is the root */
      snprintf(dir, sizeof dir, "/sys/fs/cgroup%s", rel);
      if (is_dir_with(dir, "memory.max") || is_dir_with(dir, "memory.current")) {
        snprintf(cgroup_dir, sizeof cgroup_dir, "%s", dir);
        cgroup_v2 = 1;
      } else if (is_dir_with("/sys/fs/cgroup", "memory.max")) {
        snprintf(cgroup_dir, sizeof cgroup_dir, "/sys/fs/cgroup");
        cgroup_v2 = 1;
      }
    } else if (v1_memory) {
      snprintf(dir, sizeof dir, "/sys/fs/cgroup/memory%s", rel);
      if (!is_dir_with(dir, "memory.limit_in_bytes")) snprintf(dir, sizeof dir, "/sys/fs/cgroup/memory");
      if (is_dir_with(dir, "memory.limit_in_bytes")) {
        snprintf(cgroup_dir, sizeof cgroup_dir, "%s", dir);
        cgroup_v2 = 0;
        return; /* the v1 memory controller wins over a v2 line without one */
      }
    }
  }
}

/* Headroom under the cgroup's memory limit, and the limit; 0 when there is none. */
static int cgroup_headroom(uint64_t *headroom, uint64_t *limit) {
  pthread_once(&cgroup_once, find_cgroup);
  if (!cgroup_dir[0]) return 0;
  char path[600], stat[8192];
  if (!cgroup_v2) {
    uint64_t usage, lim = UINT64_MAX, file_in = 0, file_act = 0;
    snprintf(path, sizeof path, "%s/memory.stat", cgroup_dir);
    if (read_text(path, stat, sizeof stat) < 0) return 0;
    if (field(stat, "hierarchical_memory_limit ", &lim) < 0) {
      snprintf(path, sizeof path, "%s/memory.limit_in_bytes", cgroup_dir);
      if (number_file(path, &lim) < 0) return 0;
    }
    snprintf(path, sizeof path, "%s/memory.usage_in_bytes", cgroup_dir);
    if (lim >= NO_LIMIT || number_file(path, &usage) < 0) return 0;
    (void)field(stat, "total_inactive_file ", &file_in);
    (void)field(stat, "total_active_file ", &file_act);
    const uint64_t held = usage > file_in + file_act ? usage - file_in - file_act : 0;
    *headroom = lim > held ? lim - held : 0;
    *limit = lim;
    return 1;
  }
  /* v2: every ancestor's memory.max applies; the tightest headroom wins. */
  char dir[512];
  snprintf(dir, sizeof dir, "%s", cgroup_dir);
  int found = 0;
  for (;;) {
    uint64_t lim, current, file_in = 0, file_act = 0;
    snprintf(path, sizeof path, "%s/memory.max", dir);
    if (number_file(path, &lim) == 0 && lim < NO_LIMIT) {
      snprintf(path, sizeof path, "%s/memory.current", dir);
      if (number_file(path, &current) == 0) {
        snprintf(path, sizeof path, "%s/memory.stat", dir);
        if (read_text(path, stat, sizeof stat) == 0) {
          (void)field(stat, "inactive_file ", &file_in);
          (void)field(stat, "active_file ", &file_act);
        }
        const uint64_t held = current > file_in + file_act ? current - file_in - file_act : 0;
        const uint64_t room = lim > held ? lim - held : 0;
        if (!found || room < *headroom) *headroom = room;
        if (!found || lim < *limit) *limit = lim;
        found = 1;
      }
    }
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir || strcmp(dir, "/sys/fs/cgroup") == 0) break;
    *slash = '\0';
  }
  return found;
}

static size_t clamp(uint64_t v) { return v > SIZE_MAX ? SIZE_MAX : (size_t)v; }

void _llmmem_pool_host_limits(pool_host_limits_t *out) {
  out->available = SIZE_MAX;
  out->bound = "no limit known";
  out->total = SIZE_MAX;
  out->va_limit = USER_ADDRESS_SPACE;
  out->va_used = 0;
  char text[8192];
  if (read_text("/proc/meminfo", text, sizeof text) == 0) {
    uint64_t avail_kb, swap_free_kb = 0, total_kb, swap_total_kb = 0;
    if (field(text, "MemAvailable:", &avail_kb) < 0) { /* kernels before 3.14 */
      uint64_t free_kb = 0, cached_kb = 0, buffers_kb = 0;
      (void)field(text, "MemFree:", &free_kb);
      (void)field(text, "Cached:", &cached_kb);
      (void)field(text, "Buffers:", &buffers_kb);
      avail_kb = free_kb + cached_kb + buffers_kb;
    }
    (void)field(text, "SwapFree:", &swap_free_kb);
    out->available = clamp((avail_kb + swap_free_kb) * 1024);
    out->bound = "MemAvailable + SwapFree";
    if (field(text, "MemTotal:", &total_kb) == 0) {
      (void)field(text, "SwapTotal:", &swap_total_kb);
      out->total = clamp((total_kb + swap_total_kb) * 1024);
    }
  }
  uint64_t headroom = 0, limit = 0;
  if (cgroup_headroom(&headroom, &limit)) {
    if (headroom < out->available) {
      out->available = clamp(headroom);
      out->bound = "the cgroup's memory limit";
    }
    if (limit < out->total) out->total = clamp(limit);
  }
  struct rlimit rl;
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (getrlimit(RLIMIT_DATA, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    uint64_t data_kb;
    if (read_text("/proc/self/status", text, sizeof text) == 0 && field(text, "VmData:", &data_kb) == 0) {
      const uint64_t used = data_kb * 1024, room = rl.rlim_cur > used ? rl.rlim_cur - used : 0;
      if (room < out->available) {
        out->available = clamp(room);
        out->bound = "RLIMIT_DATA";
      }
    }
    if (rl.rlim_cur < out->total) out->total = clamp(rl.rlim_cur);
  }
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    out->va_limit = clamp(rl.rlim_cur);
    if (rl.rlim_cur < out->total) out->total = clamp(rl.rlim_cur);
  }
  if (read_text("/proc/self/statm", text, sizeof text) == 0) {
    unsigned long long pages = strtoull(text, NULL, 10);
    out->va_used = clamp((uint64_t)pages * page);
  }
}

LLMMEM_API llmmem_status_t llmmem_pool_host_memory(size_t *available, size_t *total, const char **bound) {
  pool_host_limits_t lim;
  _llmmem_pool_host_probe(&lim);
  if (available) *available = lim.available;
  if (total) *total = lim.total;
  if (bound) *bound = lim.bound;
  return LLMMEM_OK;
}
