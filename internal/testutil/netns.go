package testutil

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// netnsTimeout bounds each `ip netns` command.
const netnsTimeout = 10 * time.Second

// CreateNetns creates a named network namespace (`ip netns add`).
func CreateNetns(ctx context.Context, name string) error { return ipNetns(ctx, "add", name) }

// DeleteNetns deletes a named network namespace (`ip netns del`).
func DeleteNetns(ctx context.Context, name string) error { return ipNetns(ctx, "del", name) }

func ipNetns(ctx context.Context, verb, name string) error {
	ctx, cancel := context.WithTimeout(ctx, netnsTimeout)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "ip", "netns", verb, name).CombinedOutput(); err != nil {
		return fmt.Errorf("ip netns %s %s: %w: %s", verb, name, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// NewNetns creates a named network namespace for the test and deletes it when the test ends,
// failed or not. The name is unique, so tests can run in parallel and a leftover from a crashed
// run never collides.
func NewNetns(t testing.TB) string {
	t.Helper()
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	name := "ipmasq-t-" + hex.EncodeToString(b[:])
	if err := CreateNetns(context.Background(), name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := DeleteNetns(context.Background(), name); err != nil {
			t.Error(err)
		}
	})
	return name
}

// enter moves the calling thread, which the caller has locked, into the named namespace.
func enter(name string) error { return enterPath("/run/netns/" + name) }

// enterPath moves the calling thread, which the caller has locked, into the network namespace
// whose file is path (a /run/netns name, or /proc/PID/ns/net).
func enterPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer f.Close()
	if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("setns %s: %w", path, err)
	}
	return nil
}

// Do runs fn on an OS thread that has entered the named namespace. Sockets fn creates belong to
// that namespace for their whole life and may be used from any goroutine afterwards. fn runs on
// a goroutine of its own, so it must not stop the test (t.Fatal); InNetns is for that.
func Do(ns string, fn func() error) error { return DoPath("/run/netns/"+ns, fn) }

// DoPath is Do for the namespace whose file is path. The thread returns to its own namespace
// before it runs other goroutines; one that cannot return stays locked and ends with the
// goroutine. Returning matters even though a locked goroutine's thread normally ends with it:
// the process's main thread never ends, so Go keeps it, idle, wherever it was left, and
// /proc/PID/ns/net (which is the main thread's) would name the test's namespace for good.
func DoPath(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			errc <- fmt.Errorf("open own netns: %w", err)
			return
		}
		defer orig.Close()
		if err := enterPath(path); err != nil {
			errc <- err
			return
		}
		err = fn()
		if unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// InNetns runs fn on the calling goroutine's thread moved into the named namespace, and moves
// the thread back afterwards, so that fn may fail the test. Sockets and links fn creates stay in
// that namespace.
func InNetns(t testing.TB, name string, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	if err != nil {
		t.Fatal(err)
	}
	defer orig.Close()
	if err := enter(name); err != nil {
		t.Fatalf("enter netns %s: %v", name, err)
	}
	defer func() {
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			// The thread cannot be trusted any more: keep it locked, so it dies with the goroutine.
			runtime.LockOSThread()
			t.Errorf("return from netns %s: %v", name, err)
		}
	}()
	fn()
}

// ipBatchTimeout bounds an `ip -batch` run.
const ipBatchTimeout = 20 * time.Second

// IPBatch runs ip commands (one per line, without the leading "ip") inside the named namespace,
// as one `ip -n NS -batch -`; opts go before -n (such as "-6": IPv6 rules need it, which a
// batch line cannot say). Its error carries ip's output and the batch.
func IPBatch(ctx context.Context, ns, batch string, opts ...string) error {
	ctx, cancel := context.WithTimeout(ctx, ipBatchTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", append(opts, "-n", ns, "-batch", "-")...)
	cmd.Stdin = strings.NewReader(batch)
	cmd.WaitDelay = time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s -n %s -batch: %w: %s\n%s", strings.Join(opts, " "), ns, err, strings.TrimSpace(string(out)), batch)
	}
	return nil
}
