// Package datapathtest is a datapath in memory for the tests of what drives or reads one (the
// agent, metrics, the command line): Backend records the policies applied to it and reports
// the counters it is given; NATBackend adds a NAT table and an attach mode, as the BPF backend
// has; DriftBackend adds drift checks that tests damage.
package datapathtest

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Wait bounds WaitApply: what drives a datapath reacts in milliseconds, so reaching it means a
// lost event, not a slow machine.
const Wait = 10 * time.Second

// Name is what the fakes' Name returns.
const Name = "fake"

// Backend is a datapath.Backend in memory; the zero value is ready to use. Set its exported
// fields before use (SetRuleCounters changes them later); its methods are safe to call
// concurrently.
type Backend struct {
	// Gate, when set, makes Apply wait until it is closed (or its context is done).
	Gate chan struct{}
	// RuleCounters and CountersErr are what Counters returns. With BlockCounters, Counters
	// waits for its context instead.
	RuleCounters  []datapath.RuleCounter
	CountersErr   error
	BlockCounters bool

	mu                     sync.Mutex
	failApplies, failClean int
	cleanups, reads        int
	applied                chan *policy.Policy
}

var _ datapath.Backend = (*Backend)(nil)

// ErrApply is the error of the applies FailApplies makes fail, as a backend's tool reports one.
var ErrApply = errors.New("fake: iptables-restore: line 3 failed")

// ErrCleanup is the error of the cleanups FailCleanups makes fail.
var ErrCleanup = errors.New("fake: busy")

func (b *Backend) Name() string { return Name }

// Apply records p (see WaitApply), or fails as FailApplies asked.
func (b *Backend) Apply(ctx context.Context, p *policy.Policy) error { return b.apply(ctx, p, nil) }

// apply is Apply, with done (when set) run once the apply succeeded and before it can be seen
// (WaitApply): what an apply changes is in place by the time a test sees it.
func (b *Backend) apply(ctx context.Context, p *policy.Policy, done func()) error {
	b.mu.Lock()
	fail := b.failApplies > 0
	if fail {
		b.failApplies--
	}
	applied := b.appliedLocked()
	b.mu.Unlock()
	if b.Gate != nil {
		select {
		case <-b.Gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if fail {
		return ErrApply
	}
	if done != nil {
		done()
	}
	applied <- p
	return nil
}

func (b *Backend) appliedLocked() chan *policy.Policy {
	if b.applied == nil {
		b.applied = make(chan *policy.Policy, 100)
	}
	return b.applied
}

// Applied receives every policy applied, in order (WaitApply takes from it too).
func (b *Backend) Applied() <-chan *policy.Policy {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.appliedLocked()
}

// Counters implements datapath.Backend.
func (b *Backend) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	b.mu.Lock()
	b.reads++
	counters, err := slices.Clone(b.RuleCounters), b.CountersErr
	b.mu.Unlock()
	if b.BlockCounters {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return counters, err
}

// SetRuleCounters changes what Counters returns.
func (b *Backend) SetRuleCounters(counters []datapath.RuleCounter) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.RuleCounters = counters
}

// Cleanup counts the cleanups, or fails as FailCleanups asked.
func (b *Backend) Cleanup(context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cleanups++
	if b.failClean > 0 {
		b.failClean--
		return ErrCleanup
	}
	return nil
}

// FailApplies makes the next n applies fail with ErrApply.
func (b *Backend) FailApplies(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failApplies = n
}

// FailCleanups makes the next n cleanups fail with ErrCleanup.
func (b *Backend) FailCleanups(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failClean = n
}

// Cleanups counts the calls of Cleanup, failed ones included.
func (b *Backend) Cleanups() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cleanups
}

// Reads counts the calls of Counters.
func (b *Backend) Reads() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reads
}

// WaitApply returns the next policy applied, failing the test after Wait.
func (b *Backend) WaitApply(t testing.TB) *policy.Policy {
	t.Helper()
	select {
	case p := <-b.Applied():
		return p
	case <-time.After(Wait):
		t.Fatal("no apply within", Wait)
		return nil
	}
}

// NoApply checks that nothing is applied for d.
func (b *Backend) NoApply(t testing.TB, d time.Duration) {
	t.Helper()
	select {
	case p := <-b.Applied():
		t.Fatalf("unexpected apply of %+v", p)
	case <-time.After(d):
	}
}

// Drain forgets the policies applied so far.
func (b *Backend) Drain() {
	for {
		select {
		case <-b.Applied():
		default:
			return
		}
	}
}

// NATBackend is a Backend with a NAT table and an attach mode (datapath.NATReporter and
// datapath.InfoReporter), as the BPF backend has. It is a datapath.Reader too.
type NATBackend struct {
	Backend
	// Installed is what Info returns.
	Installed datapath.Info
	// Stats and StatsErr are what NATStats returns; Summary is what NATSummary returns, its
	// Busiest cut to top.
	Stats    datapath.NATStats
	StatsErr error
	Summary  datapath.NATSummary
}

var (
	_ datapath.NATReporter  = (*NATBackend)(nil)
	_ datapath.InfoReporter = (*NATBackend)(nil)
	_ datapath.Reader       = (*NATBackend)(nil)
)

func (n *NATBackend) Info() datapath.Info { return n.Installed }

func (n *NATBackend) NATStats(context.Context) (datapath.NATStats, error) {
	return n.Stats, n.StatsErr
}

func (n *NATBackend) NATSummary(_ context.Context, top int) (datapath.NATSummary, error) {
	s := n.Summary
	s.Busiest = s.Busiest[:max(0, min(top, len(s.Busiest)))]
	return s, nil
}

// HookBackend is a NATBackend that reports hooks (datapath.HookReporter) and uplinks
// (datapath.UplinkReporter), as the BPF backend does: Hook and HooksErr are what Hooks returns,
// Uplink what Uplinks does.
type HookBackend struct {
	NATBackend
	Hook     []datapath.Hook
	HooksErr error
	Uplink   []datapath.Uplink
}

var (
	_ datapath.HookReporter   = (*HookBackend)(nil)
	_ datapath.UplinkReporter = (*HookBackend)(nil)
)

func (h *HookBackend) Hooks(context.Context) ([]datapath.Hook, error) { return h.Hook, h.HooksErr }

func (h *HookBackend) Uplinks(context.Context) ([]datapath.Uplink, error) { return h.Uplink, nil }

// DriftBackend is a Backend with drift checks (datapath.DriftChecker): Damage drifts it, and an
// Apply repairs what drifted except the kinds Stick keeps.
type DriftBackend struct {
	Backend
	dmu     sync.Mutex
	drifted []string
	stuck   []string
	checks  int
	fail    error
}

var _ datapath.DriftChecker = (*DriftBackend)(nil)

// Apply applies as Backend does, then repairs the drift that is not stuck.
func (d *DriftBackend) Apply(ctx context.Context, p *policy.Policy) error {
	// The repair comes before the apply can be seen: a test that damages the datapath once it
	// saw an apply must not have its damage repaired by that apply.
	return d.Backend.apply(ctx, p, func() {
		d.dmu.Lock()
		defer d.dmu.Unlock()
		d.drifted = slices.DeleteFunc(d.drifted, func(k string) bool { return !slices.Contains(d.stuck, k) })
	})
}

// DriftKinds are those of a BPF-like datapath.
func (d *DriftBackend) DriftKinds() []string {
	return []string{datapath.DriftProgram, datapath.DriftPin, datapath.DriftTrie}
}

// CheckDrift reports what drifted, or fails as FailChecks asked; it counts the checks.
func (d *DriftBackend) CheckDrift(context.Context) ([]string, error) {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	d.checks++
	if d.fail != nil {
		return nil, d.fail
	}
	return slices.Clone(d.drifted), nil
}

// Damage makes kinds drift (replacing what drifted before).
func (d *DriftBackend) Damage(kinds ...string) {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	d.drifted = kinds
}

// Stick keeps kinds drifted through applies (none: every kind is repaired again).
func (d *DriftBackend) Stick(kinds ...string) {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	d.stuck = kinds
}

// FailChecks makes every check fail with err until it is called with nil.
func (d *DriftBackend) FailChecks(err error) {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	d.fail = err
}

// Checks counts the calls of CheckDrift.
func (d *DriftBackend) Checks() int {
	d.dmu.Lock()
	defer d.dmu.Unlock()
	return d.checks
}
