package agent

import (
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
)

// TestDisplaceAfterFirstApply: the other backend is removed only once a policy is in place (not
// while only a bad file is at hand), once, and again after a failure until it succeeds.
func TestDisplaceAfterFirstApply(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("masqOutBound: maybe\n")
	b := &datapathtest.Backend{}
	other := &datapathtest.Backend{}
	other.FailCleanups(1)
	third := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b, func(o *Options) { o.Displace = []datapath.Displaced{other, third} })
	b.NoApply(t, 200*time.Millisecond)
	if n := other.Cleanups(); n != 0 {
		t.Fatalf("the other backend was removed %d times before any policy was applied", n)
	}

	cm.write("resyncInterval: 100ms\n")
	b.WaitApply(t)
	r.waitReady(t)
	// The first removal fails; the next apply (a resync) retries it.
	b.WaitApply(t)
	if err := testutil.Poll(waitFor, time.Millisecond, func() error {
		if n := other.Cleanups(); n < 2 {
			return testutil.NotYet("the failed removal retried: %d calls", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Once removed, never again.
	b.WaitApply(t)
	b.WaitApply(t)
	if n := other.Cleanups(); n != 2 {
		t.Fatalf("the other backend was removed %d times, want 2 (a failure and a success)", n)
	}
	logs := r.log.String()
	if !strings.Contains(logs, "cannot remove the other backend's state") || !strings.Contains(logs, "the other backend's state is removed") {
		t.Errorf("logs lack the removal:\n%s", logs)
	}
	if n := third.Cleanups(); n != 1 {
		t.Errorf("the third backend was removed %d times, want 1", n)
	}
	// The end of the displacement is said once, after the last removal.
	const done = "no other backend's state is left"
	if n := strings.Count(logs, done); n != 1 {
		t.Errorf("%q logged %d times, want 1:\n%s", done, n, logs)
	}
	if strings.Index(logs, done) < strings.LastIndex(logs, "the other backend's state is removed") {
		t.Errorf("%q logged before the last removal:\n%s", done, logs)
	}
}
