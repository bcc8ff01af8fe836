package nodelock

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// holdEnv makes the test binary a helper process that takes the lock it names, says "held",
// starts `sleep` (a child that must not inherit the lock) and waits to be killed.
const holdEnv = "NODELOCK_TEST_HOLD"

func TestMain(m *testing.M) {
	if name := os.Getenv(holdEnv); name != "" {
		os.Exit(hold(name))
	}
	os.Exit(m.Run())
}

func hold(name string) int {
	l, err := TryAcquire(name, Me("agent", "test"))
	if err != nil {
		fmt.Println(err)
		return 1
	}
	defer l.Release()
	child := exec.Command("sleep", "600")
	if err := child.Start(); err != nil {
		fmt.Println(err)
		return 1
	}
	fmt.Printf("held %d\n", child.Process.Pid)
	select {}
}

// testName is a lock name of the test's own: the unit tests run in the host's namespace, where
// the real name may be taken.
func testName(t *testing.T) string {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "ip-masq-agent-test-" + hex.EncodeToString(b[:])
}

func TestTryAcquire(t *testing.T) {
	name := testName(t)
	me := Me("agent", "v1.2.3")
	l, err := TryAcquire(name, me)
	if err != nil {
		t.Fatal(err)
	}
	_, err = TryAcquire(name, Me("cleanup", "v1.2.3"))
	held, ok := errors.AsType[*HeldError](err)
	if !ok {
		t.Fatalf("second TryAcquire: %v, want a HeldError", err)
	}
	if h := held.Holder; h.Command != "agent" || h.Pid != os.Getpid() || h.Version != "v1.2.3" || !h.Since.Equal(me.Since.Round(0)) || h.UID != os.Getuid() {
		t.Errorf("holder %+v, want %+v", h, me)
	}
	want := fmt.Sprintf("the node lock is held by ip-masq-agent agent (pid %d, uid %d, version v1.2.3, since ", os.Getpid(), os.Getuid())
	if !strings.HasPrefix(err.Error(), want) {
		t.Errorf("error %q, want it to start with %q", err, want)
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if err := l.Release(); err != nil {
		t.Errorf("second release: %v", err)
	}
	if h := Describe(name); h != (Holder{}) {
		t.Errorf("released, yet described as held by %+v", h)
	}
	l2, err := TryAcquire(name, me)
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	l2.Release()
}

// TestAcquireWaits: Acquire waits while the lock is held, reports the holder once, and takes
// the lock once it is released.
func TestAcquireWaits(t *testing.T) {
	name := testName(t)
	first, err := TryAcquire(name, Me("agent", "first"))
	if err != nil {
		t.Fatal(err)
	}
	waited := make(chan Holder, 10)
	got := make(chan error, 1)
	var second *Lock
	go func() {
		var err error
		second, err = Acquire(context.Background(), name, Me("agent", "second"), func(h Holder) { waited <- h })
		got <- err
	}()
	h := <-waited
	if h.Version != "first" {
		t.Errorf("waiting for %+v, want the first holder", h)
	}
	// Several tries pass while the first holds the lock; none takes it.
	time.Sleep(3 * PollInterval)
	select {
	case err := <-got:
		t.Fatalf("Acquire returned while the lock was held: %v", err)
	default:
	}
	if len(waited) != 0 {
		t.Errorf("the same holder was reported %d more times", len(waited))
	}
	first.Release()
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	defer second.Release()
	if h := Describe(name); h.Version != "second" {
		t.Errorf("held by %+v, want the second", h)
	}
}

// TestHeldByAnother: a process that took the name without the protocol is described by the
// uid the kernel reports.
func TestHeldByAnother(t *testing.T) {
	name := testName(t)
	ln, err := net.Listen("unix", "@"+name)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close() // says nothing
		}
	}()
	_, err = TryAcquire(name, Me("agent", "test"))
	want := fmt.Sprintf("the node lock is held by another process (uid %d), which does not say who it is", os.Getuid())
	if err == nil || err.Error() != want {
		t.Fatalf("err = %v, want %q", err, want)
	}
}

func TestAcquireCancelled(t *testing.T) {
	name := testName(t)
	l, err := TryAcquire(name, Me("agent", "first"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = Acquire(ctx, name, Me("agent", "second"), nil)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "held by ip-masq-agent agent") {
		t.Fatalf("err = %v, want a cancelled wait that names the holder", err)
	}
}

// TestReleasedByDeath: a holder killed with SIGKILL gives the lock up, even though a child it
// started (as the agent starts iptables-restore) still runs.
func TestReleasedByDeath(t *testing.T) {
	name := testName(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), holdEnv+"="+name)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	var sleeper int
	if _, serr := fmt.Sscanf(line, "held %d", &sleeper); err != nil || serr != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("helper: %q %v %v", line, err, serr)
	}
	defer syscall.Kill(sleeper, syscall.SIGKILL)

	_, err = TryAcquire(name, Me("agent", "test"))
	if held, ok := errors.AsType[*HeldError](err); !ok || held.Holder.Pid != cmd.Process.Pid {
		t.Fatalf("while the helper holds it: %v, want held by pid %d", err, cmd.Process.Pid)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if err := syscall.Kill(sleeper, 0); err != nil {
		t.Fatalf("the helper's child is gone too (%v): the test proves nothing", err)
	}
	l, err := TryAcquire(name, Me("agent", "test"))
	if err != nil {
		t.Fatalf("after the holder died: %v", err)
	}
	l.Release()
}
