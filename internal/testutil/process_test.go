package testutil

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A started process's lines are awaited, SIGTERM ends it with its status, and the end of its
// output comes with an error.
func TestProcess(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := Start(ctx, t, "sh", "-c", "echo starting; echo ready 42 >&2; exec sleep 600")
	line, err := p.WaitLine(10*time.Second, "ready ")
	if err != nil || line != "ready 42" {
		t.Fatalf("WaitLine = %q, %v; want the whole line", line, err)
	}
	if exited, err := p.Exited(); exited {
		t.Fatalf("exited (%v) while it sleeps", err)
	}
	err = p.Stop(ctx)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
		t.Fatalf("Stop = %v, want the exit by SIGTERM", err)
	}
	if !strings.Contains(err.Error(), "its output ends:\nstarting\nready 42") {
		t.Errorf("Stop's error does not end with the output: %v", err)
	}
}

// WaitLine stops waiting when the process ends without the line, and says what it wrote.
func TestWaitLineExited(t *testing.T) {
	p := Start(context.Background(), t, "sh", "-c", "echo no such thing; exit 3")
	start := time.Now()
	_, err := p.WaitLine(time.Minute, "ready")
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "no such thing") {
		t.Fatalf("WaitLine = %v, want the exit and the output", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("WaitLine took %v after the exit", took)
	}
}

// KillGroup ends what the process started too.
func TestKillGroup(t *testing.T) {
	p := Start(context.Background(), t, "sh", "-c", "sleep 600 & echo child $!; wait")
	line, err := p.WaitLine(10*time.Second, "child ")
	if err != nil {
		t.Fatal(err)
	}
	var child int
	if _, err := fmt.Sscanf(line, "child %d", &child); err != nil {
		t.Fatal(err)
	}
	if err := p.KillGroup(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	if err := Poll(10*time.Second, 10*time.Millisecond, func() error {
		// Gone, or a zombie that its new parent has yet to reap.
		if stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", child)); err == nil && !strings.Contains(string(stat), ") Z ") {
			return NotYet("the child %d gone: %s", child, stat)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// PollContext asks until ctx ends, and says what it awaited.
func TestPollContext(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	asked := 0
	err := PollContext(ctx, time.Millisecond, func() error {
		asked++
		return NotYet("the moon")
	})
	if !errors.Is(err, ErrNotYet) || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "the moon") {
		t.Errorf("PollContext = %v, want what it awaited and the deadline", err)
	}
	if asked < 2 {
		t.Errorf("asked %d times", asked)
	}
	if err := Poll(time.Second, 0, func() error { return errors.New("broken") }); err == nil || err.Error() != "broken" {
		t.Errorf("Poll = %v, want the condition's own error at once", err)
	}
}
