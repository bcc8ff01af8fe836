package agent

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// otherBackend is a displaced backend that counts its cleanups and fails the first failFirst.
type otherBackend struct {
	mu        sync.Mutex
	failFirst int
	calls     int
}

func (o *otherBackend) Name() string { return "other" }

func (o *otherBackend) Cleanup(context.Context) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.calls++
	if o.calls <= o.failFirst {
		return errors.New("other: busy")
	}
	return nil
}

func (o *otherBackend) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.calls
}

// TestDisplaceAfterFirstApply: the other backend is removed only once a policy is in place (not
// while only a bad file is at hand), once, and again after a failure until it succeeds.
func TestDisplaceAfterFirstApply(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("masqOutBound: maybe\n")
	b := newFakeBackend()
	other := &otherBackend{failFirst: 1}
	r := startAgent(t, cm.path(), b, func(o *Options) { o.Displace = []Displaced{other} })
	b.noApply(t, 200*time.Millisecond)
	if n := other.count(); n != 0 {
		t.Fatalf("the other backend was removed %d times before any policy was applied", n)
	}

	cm.write("resyncInterval: 100ms\n")
	b.waitApply(t)
	r.waitReady(t)
	// The first removal fails; the next apply (a resync) retries it.
	b.waitApply(t)
	deadline := time.Now().Add(waitFor)
	for other.count() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the failed removal was not retried: %d calls", other.count())
		}
		time.Sleep(time.Millisecond)
	}
	// Once removed, never again.
	b.waitApply(t)
	b.waitApply(t)
	if n := other.count(); n != 2 {
		t.Fatalf("the other backend was removed %d times, want 2 (a failure and a success)", n)
	}
	logs := r.log.String()
	if !strings.Contains(logs, "cannot remove the other backend's state") || !strings.Contains(logs, "the other backend's state is removed") {
		t.Errorf("logs lack the removal:\n%s", logs)
	}
}
