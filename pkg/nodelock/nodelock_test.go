package nodelock

import (
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

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// holdEnv makes the test binary a helper process that takes the lock it names, says "held",
// starts `sleep` (a child that must not inherit the lock) and waits to be killed.
const holdEnv = "NODELOCK_TEST_HOLD"

func TestMain(m *testing.M) {
	if name := os.Getenv(holdEnv); name != "" {
		os.Exit(hold(name))
	}
	if name := os.Getenv(askEnv); name != "" {
		os.Exit(ask(name))
	}
	if name := os.Getenv(describeEnv); name != "" {
		h := Describe(name)
		fmt.Printf("%s pid %d, local pid %d\n", h.Command, h.Pid, h.LocalPid)
		os.Exit(0)
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
		second, err = Acquire(context.Background(), name, Me("agent", "second"), func(w Wait) { waited <- w.Holder })
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
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(), holdEnv+"="+name)
	helper := testutil.StartCmd(t, cmd)
	line, err := helper.WaitLine(time.Minute, "held ")
	if err != nil {
		t.Fatalf("helper: %v", err)
	}
	var sleeper int
	if _, err := fmt.Sscanf(line, "held %d", &sleeper); err != nil {
		t.Fatalf("helper: %q: %v", line, err)
	}
	defer syscall.Kill(sleeper, syscall.SIGKILL)

	_, err = TryAcquire(name, Me("agent", "test"))
	if held, ok := errors.AsType[*HeldError](err); !ok || held.Holder.Pid != helper.Pid() {
		t.Fatalf("while the helper holds it: %v, want held by pid %d", err, helper.Pid())
	}
	if err := helper.Kill(ctx); err != nil { // the helper alone: its child lives on
		t.Fatal(err)
	}
	if err := syscall.Kill(sleeper, 0); err != nil {
		t.Fatalf("the helper's child is gone too (%v): the test proves nothing", err)
	}
	l, err := TryAcquire(name, Me("agent", "test"))
	if err != nil {
		t.Fatalf("after the holder died: %v", err)
	}
	l.Release()
}

// agent describes an agent of a pod of the given template generation.
func agent(version string, generation int64) Holder {
	h := Me("agent", version)
	h.Generation = generation
	return h
}

// TestHandOver: an agent of a later generation asks the holder to hand over; the holder
// agrees once, is told who supersedes it, and the newer agent takes the lock as soon as the
// holder releases it.
func TestHandOver(t *testing.T) {
	name := testName(t)
	old, err := TryAcquire(name, agent("old", 3))
	if err != nil {
		t.Fatal(err)
	}
	defer old.Release()
	waits := make(chan Wait, 10)
	got := make(chan error, 1)
	var newer *Lock
	go func() {
		var err error
		newer, err = Acquire(context.Background(), name, agent("new", 4), func(w Wait) { waits <- w })
		got <- err
	}()
	w := <-waits
	if !w.HandingOver || w.Refused != "" || w.Holder.Version != "old" || w.Holder.Generation != 3 {
		t.Errorf("the newer agent waits for %+v, want the old holder handing over", w)
	}
	// Asked before the holder looks (an agent that has just taken the lock), it agrees all the
	// same: the holder is told when it does look.
	to := <-old.HandOvers()
	if to.Version != "new" || to.Generation != 4 || to.UID != os.Getuid() {
		t.Errorf("handing over to %+v, want the newer agent with the kernel's uid", to)
	}
	// Agreed once: a third agent, newer still, is refused while the handover is under way.
	if agreed, why := askHandOver(name, agent("third", 5)); agreed || !strings.Contains(why, "already hands over") {
		t.Errorf("a second request: agreed %v (%s), want refused", agreed, why)
	}
	select {
	case err := <-got:
		t.Fatalf("Acquire returned before the holder let go: %v", err)
	case <-time.After(2 * PollInterval):
	}
	old.Release()
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	defer newer.Release()
	if h := Describe(name); h.Version != "new" || h.Generation != 4 {
		t.Errorf("held by %+v, want the newer agent", h)
	}
}

// TestNoHandOverBack: an agent of an older generation (the old pod's container, restarted by
// the kubelet after the handover) does not ask the newer holder to step down, and the holder
// refuses if asked; nor does an agent of unknown generation, or one of the same.
func TestNoHandOverBack(t *testing.T) {
	name := testName(t)
	holder, err := TryAcquire(name, agent("new", 4))
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	handOvers := holder.HandOvers()
	for _, gen := range []int64{3, 4, 0} {
		ctx, cancel := context.WithTimeout(context.Background(), 3*PollInterval)
		var w Wait
		_, err := Acquire(ctx, name, agent("other", gen), func(got Wait) { w = got })
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || w.HandingOver || w.Refused != "" {
			t.Errorf("generation %d: %v, waited for %+v; want a plain wait", gen, err, w)
		}
		if agreed, why := askHandOver(name, agent("other", gen)); agreed || !strings.Contains(why, "does not supersede") {
			t.Errorf("generation %d asks anyway: agreed %v (%s), want refused", gen, agreed, why)
		}
	}
	select {
	case h := <-handOvers:
		t.Fatalf("the holder agreed to hand over to %+v", h)
	default:
	}
}

// TestHandOverRefused: holders that do not hand over (cleanup; an agent of unknown
// generation; one of a release before the handover, which hangs up after its line) leave the
// newer agent waiting, with the reason.
func TestHandOverRefused(t *testing.T) {
	for what, h := range map[string]Holder{"cleanup": Me("cleanup", "old"), "unknown generation": agent("old", 0)} {
		t.Run(what, func(t *testing.T) {
			name := testName(t)
			l, err := TryAcquire(name, h)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Release()
			ctx, cancel := context.WithTimeout(context.Background(), 2*PollInterval)
			defer cancel()
			var w Wait
			_, _ = Acquire(ctx, name, agent("new", 2), func(got Wait) { w = got })
			if w.HandingOver || w.Refused != "" || w.Holder.Version != "old" {
				t.Errorf("waited for %+v, want a plain wait", w)
			}
			if agreed, why := askHandOver(name, agent("new", 2)); agreed || why != "the holder does not hand over" {
				t.Errorf("agreed %v (%s), want refused", agreed, why)
			}
			select {
			case to := <-l.HandOvers():
				t.Errorf("the holder is told to hand over to %+v", to)
			default:
			}
		})
	}
	t.Run("an older release", func(t *testing.T) {
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
				_, _ = c.Write([]byte(`{"command":"agent","pid":1,"version":"v0.0.1","since":"2026-01-01T00:00:00Z"}` + "\n"))
				c.Close()
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 2*PollInterval)
		defer cancel()
		var w Wait
		// Its line has no generation: nothing to supersede, so nothing is asked.
		_, _ = Acquire(ctx, name, agent("new", 2), func(got Wait) { w = got })
		if w.HandingOver || w.Refused != "" || w.Holder.Version != "v0.0.1" {
			t.Errorf("waited for %+v, want a plain wait for the old release", w)
		}
		if agreed, why := askHandOver(name, agent("new", 2)); agreed || !strings.Contains(why, "a release before the handover") {
			t.Errorf("agreed %v (%s), want refused", agreed, why)
		}
	})
}

// askEnv makes the test binary a helper that asks the holder of the lock it names to hand over
// to a newer agent, and prints the answer.
const askEnv = "NODELOCK_TEST_ASK"

// TestHandOverOtherUser: a process of another user cannot make the agent step down, whatever
// generation it claims (the socket has no permissions; the kernel's uid decides).
func TestHandOverOtherUser(t *testing.T) {
	testutil.RequirePrivileged(t)
	name := testName(t)
	l, err := TryAcquire(name, agent("old", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	handOvers := l.HandOvers()
	// A copy of the test binary the other user may run (go test's build folder is root's only).
	self, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "nodelock-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	bin := dir + "/nodelock.test"
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, self, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), askEnv+"="+name)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v: %s", err, out)
	}
	if want := "refused: the requester's uid 65534 is not the holder's"; strings.TrimSpace(string(out)) != want {
		t.Errorf("the other user's request: %q, want %q", out, want)
	}
	select {
	case h := <-handOvers:
		t.Fatalf("the holder agreed to hand over to %+v", h)
	default:
	}
}

func ask(name string) int {
	if agreed, why := askHandOver(name, agent("impostor", 1000)); agreed {
		fmt.Println("agreed")
	} else {
		fmt.Println("refused: " + why)
	}
	return 0
}

// describeEnv makes the test binary a helper that describes the holder of the lock it names.
const describeEnv = "NODELOCK_TEST_DESCRIBE"

// TestLocalPid: the kernel tells a holder in the asker's pid namespace (a container's own
// agent: the DaemonSet's startup probe asks) from one in another (another pod's agent), whose
// own pid may well be the same.
func TestLocalPid(t *testing.T) {
	testutil.RequirePrivileged(t)
	name := testName(t)
	l, err := TryAcquire(name, agent("here", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if h := Describe(name); h.LocalPid != os.Getpid() || h.Pid != os.Getpid() {
		t.Errorf("described from its own pid namespace: %+v, want local pid %d", h, os.Getpid())
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), describeEnv+"="+name)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v: %s", err, out)
	}
	if want := fmt.Sprintf("agent pid %d, local pid 0", os.Getpid()); strings.TrimSpace(string(out)) != want {
		t.Errorf("described from another pid namespace: %q, want %q", out, want)
	}
}

// TestAnswer: the holder answers the queries it was given with their function's value or error;
// any other query, and a lock nobody holds, give ErrNoAnswer.
func TestAnswer(t *testing.T) {
	name := testName(t)
	var got map[string]int
	if _, err := Ask(name, "config", &got); !errors.Is(err, ErrNoAnswer) {
		t.Errorf("nothing holds the lock: %v, want ErrNoAnswer", err)
	}
	l, err := TryAcquire(name, Me("agent", "v1"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if h, err := Ask(name, "config", &got); !errors.Is(err, ErrNoAnswer) || h.Pid != os.Getpid() {
		t.Errorf("a query the holder does not answer: %v (holder %+v), want ErrNoAnswer from this process", err, h)
	}
	l.Answer("config", func() (any, error) { return map[string]int{"generation": 7}, nil })
	l.Answer("broken", func() (any, error) { return nil, errors.New("nothing applied yet") })
	if h, err := Ask(name, "config", &got); err != nil || got["generation"] != 7 || h.Command != "agent" {
		t.Errorf("config: %v, %v (holder %+v)", got, err, h)
	}
	if _, err := Ask(name, "broken", &got); err == nil || errors.Is(err, ErrNoAnswer) || !strings.Contains(err.Error(), "nothing applied yet") {
		t.Errorf("broken: %v, want the holder's error", err)
	}
	// A describe still reads the holder's line only.
	if h := Describe(name); h.Pid != os.Getpid() {
		t.Errorf("described as %+v", h)
	}
}
