/* Cycles the machine's pids round until the next one the kernel hands out is TARGET, for
 * tests/runtime/test_pid_reuse.py where /proc/sys/kernel/ns_last_pid cannot be written (it is
 * read-only in many containers, even for root). vfork keeps each short-lived child cheap (tens of
 * microseconds, where a fork of a pytest process with torch loaded takes tens of milliseconds), so a
 * whole wrap of the pids takes a second or two.
 * Usage: pid_cycle TARGET MAX_CHILDREN. Exit 0 once the last pid given out leaves TARGET next (the
 * pids between them, if any, are all held), 1 if MAX_CHILDREN children did not get there. */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static int only_held_between(pid_t last, pid_t target) {
    for (pid_t q = last + 1; q < target; q++)
        if (kill(q, 0) != 0 && errno == ESRCH) return 0;
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    pid_t target = (pid_t)atol(argv[1]);
    long max_children = atol(argv[2]);
    for (long i = 0; i < max_children; i++) {
        pid_t child = vfork();
        if (child == 0) _exit(0);
        if (child < 0) { usleep(1000); continue; }  /* out of pids for a moment: try again */
        waitpid(child, NULL, 0);
        if (child < target && target - child <= 64 && only_held_between(child, target)) return 0;
    }
    return 1;
}
