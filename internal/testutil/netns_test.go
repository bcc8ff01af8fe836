package testutil

import (
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// The thread that ran fn must be back in the test's own namespace when Do returns: a thread
// left behind (the main thread is never ended) keeps the namespace alive and in the process's
// /proc/PID/ns/net, which the cluster suite's leak check reads.
func TestDoReturnsThread(t *testing.T) {
	RequirePrivileged(t, "ip")
	ns := NewNetns(t)
	nsOf := func(tid int) string {
		l, err := os.Readlink(fmt.Sprintf("/proc/self/task/%d/ns/net", tid))
		if err != nil {
			t.Fatalf("thread %d: %v", tid, err)
		}
		return l
	}
	own := nsOf(unix.Gettid())
	var tid int
	var inside string
	if err := Do(ns, func() error {
		tid = unix.Gettid()
		l, err := os.Readlink(fmt.Sprintf("/proc/self/task/%d/ns/net", tid))
		inside = l
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if inside == own {
		t.Fatalf("fn ran in the test's own namespace %s, not in %s", own, ns)
	}
	if after := nsOf(tid); after != own {
		t.Fatalf("the thread that ran fn is in %s after Do, want the test's own %s", after, own)
	}
}
