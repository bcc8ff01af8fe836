package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// fakePods is a PodSource whose answers tests set.
type fakePods struct {
	mu      sync.Mutex
	pods    map[string][]netip.Addr
	known   bool
	since   time.Time
	follows [][]string // the selector rules of each Select
	changes chan struct{}
}

func newFakePods() *fakePods { return &fakePods{changes: make(chan struct{}, 1)} }

func (f *fakePods) Watch(ctx context.Context) (<-chan struct{}, error) {
	out := make(chan struct{})
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case <-f.changes:
				select {
				case out <- struct{}{}:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, nil
}

func (f *fakePods) Select(rules []config.SourceRule) (map[string][]netip.Addr, time.Time, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var names []string
	for _, r := range rules {
		if r.Selects() {
			names = append(names, r.Name)
		}
	}
	f.follows = append(f.follows, names)
	since := f.since
	f.since = time.Time{}
	if len(names) == 0 {
		return nil, since, nil
	}
	if !f.known {
		return nil, since, errors.New("not listed yet")
	}
	out := map[string][]netip.Addr{}
	for _, n := range names {
		out[n] = slices.Clone(f.pods[n])
	}
	return out, since, nil
}

// set makes the pods known, rule by rule, as changed by an event at since, and reports it.
func (f *fakePods) set(since time.Time, pods map[string][]netip.Addr) {
	f.mu.Lock()
	f.pods, f.known, f.since = pods, true, since
	f.mu.Unlock()
	select {
	case f.changes <- struct{}{}:
	default:
	}
}

func (f *fakePods) followed() [][]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.follows)
}

func withPods(f *fakePods) func(*Options) { return func(o *Options) { o.Pods = f } }

// podsObserver records the pod latencies the agent reports.
type podsObserver struct {
	applyObserver
	mu   sync.Mutex
	took []time.Duration
}

func (o *podsObserver) ObservePodsApplied(took time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.took = append(o.took, took)
}

func (o *podsObserver) latencies() []time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.took)
}

// sourcePods is the pods of the applied policy's source rule name.
func sourcePods(p *policy.Policy, name string) string {
	for _, s := range p.Sources {
		if s.Name == name {
			return fmt.Sprint(s.Pods)
		}
	}
	return "no rule " + name
}

const selecting = `resyncInterval: 1h
sourceRules:
- {name: fixed, cidrs: [10.99.0.0/16], masqOutBound: false}
- {name: batch, namespaceSelector: {matchLabels: {team: batch}}, masqOutBound: false}
`

// TestSelectorsNeedTheAPIServer: without a PodSource (no API server), a configuration whose
// rules select pods is rejected, naming each such rule and its selector, and the last good one
// stays; at startup it leaves the agent unready.
func TestSelectorsNeedTheAPIServer(t *testing.T) {
	const hint = "run the agent with --config-source=configmap"
	cm := newConfigMap(t)
	cm.write("sourceRules: [{name: fixed, cidrs: [10.99.0.0/16], masqOutBound: false}]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b, func(o *Options) { o.NoPods = hint })
	if got := b.WaitApply(t); len(got.Sources) != 1 {
		t.Fatalf("applied %d source rules, want the CIDR rule", len(got.Sources))
	}
	r.waitReady(t)

	cm.write(selecting + "- {name: canary, podSelector: {matchLabels: {track: canary}}}\n")
	s := r.waitStats(t, "the rejection", func(s Stats) bool { return s.ConfigErrors == 1 })
	b.NoApply(t, 100*time.Millisecond)
	for _, want := range []string{
		`sourceRules[1](batch).namespaceSelector: "team=batch": selects pods, which needs the API server; ` + hint,
		`sourceRules[2](canary).podSelector: "track=canary": selects pods, which needs the API server; ` + hint,
	} {
		if !strings.Contains(s.Rejected, want) {
			t.Errorf("rejected %q, want it to say %q", s.Rejected, want)
		}
	}
	if code, _ := r.ready(t); code != http.StatusOK {
		t.Errorf("a configuration that selects pods made the agent unready: %d", code)
	}

	// At startup: nothing to keep, not ready.
	cm2 := newConfigMap(t)
	cm2.write(selecting)
	r2 := startAgent(t, cm2.path(), &datapathtest.Backend{})
	r2.waitStats(t, "the rejection", func(s Stats) bool { return s.ConfigErrors == 1 })
	if code, body := r2.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "sourceRules[1](batch).namespaceSelector") ||
		!strings.Contains(body, defaultNoPods) {
		t.Errorf("/readyz %d %q, want 503 naming the rule and why", code, body)
	}
}

// TestPodsFollowed: a configuration that selects pods waits until they are known (the one in
// force stays), then applies with their addresses; a change of the pods applies again and is
// timed from its event, and applies while a bad configuration is at hand; a configuration
// without selectors makes the source follow nothing.
func TestPodsFollowed(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("resyncInterval: 1h\n")
	pods := newFakePods()
	obs := &podsObserver{}
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b, withPods(pods), func(o *Options) { o.Observer = obs })
	b.WaitApply(t)
	r.waitReady(t)

	cm.write(selecting)
	r.waitLog(t, "waiting for the pods the configuration selects; the configuration in force stays until they are known")
	b.NoApply(t, 100*time.Millisecond)
	if s := r.agent.Stats(); s.ConfigErrors != 0 || s.Rejected != "" {
		t.Errorf("a configuration waiting for its pods counted as rejected: %+v", s)
	}

	a1, a2 := netip.MustParseAddr("10.244.0.10"), netip.MustParseAddr("10.244.0.11")
	event := time.Now()
	pods.set(event, map[string][]netip.Addr{"batch": {a1}})
	p := b.WaitApply(t)
	if got := sourcePods(p, "batch"); got != "[10.244.0.10]" {
		t.Fatalf("applied batch's pods %s", got)
	}
	if p.DecideFrom(a1, netip.MustParseAddr("8.8.8.8")).Action != policy.Return || p.DecideFrom(a2, netip.MustParseAddr("8.8.8.8")).Action == policy.Return {
		t.Error("the selected pod is masqueraded, or the other is not")
	}

	event = time.Now()
	pods.set(event, map[string][]netip.Addr{"batch": {a1, a2}})
	if got := sourcePods(b.WaitApply(t), "batch"); got != "[10.244.0.10 10.244.0.11]" {
		t.Fatalf("after the change applied batch's pods %s", got)
	}
	var lat []time.Duration
	if err := testutil.Poll(waitFor, time.Millisecond, func() error {
		if lat = obs.latencies(); len(lat) < 2 {
			return testutil.NotYet("the second pod latency (have %v)", lat)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if bound := time.Since(event); len(lat) != 2 || lat[1] <= 0 || lat[1] > bound {
		t.Errorf("pod latencies %v; want two, the last at most the %v since the event", lat, bound)
	}
	t.Logf("pod event -> policy applied (fake source, datapathtest backend): %v", lat[1])

	// A bad configuration does not hold the pods of the one in force up.
	cm.write(selecting + "masqOutBound: maybe\n")
	r.waitStats(t, "the rejection", func(s Stats) bool { return s.ConfigErrors == 1 })
	pods.set(time.Now(), map[string][]netip.Addr{"batch": {a2}})
	if got := sourcePods(b.WaitApply(t), "batch"); got != "[10.244.0.11]" {
		t.Fatalf("with a bad configuration at hand applied batch's pods %s", got)
	}

	cm.write("resyncInterval: 1h\n")
	if p := b.WaitApply(t); len(p.Sources) != 0 {
		t.Errorf("applied %d source rules, want none", len(p.Sources))
	}
	f := pods.followed()
	if last := f[len(f)-1]; len(last) != 0 || !slices.Contains(f[len(f)-2], "batch") {
		t.Errorf("the source followed %v; want batch, then nothing", f)
	}
}

// The pods a rejected configuration selected are not those of the policy in force: the source
// follows the rules in force again, and the policy in force takes its pods' change.
func TestPodsOfRejectedConfig(t *testing.T) {
	cm := newConfigMap(t)
	cm.write(selecting)
	pods := newFakePods()
	pods.set(time.Now(), map[string][]netip.Addr{"batch": {netip.MustParseAddr("10.244.0.10")}})
	addrs := newFakeAddresses("10.0.0.10")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b, withPods(pods), withAddresses(addrs))
	b.WaitApply(t)
	r.waitReady(t)

	// Meanwhile the pods changed, unreported yet; the new configuration names a missing address.
	pods.mu.Lock()
	pods.pods = map[string][]netip.Addr{"batch": {netip.MustParseAddr("10.244.0.12")}, "other": {netip.MustParseAddr("10.244.0.13")}}
	pods.mu.Unlock()
	cm.write("masqueradeAddress: 10.0.0.11\nsourceRules: [{name: other, podSelector: {matchLabels: {a: b}}}]\n")
	r.waitStats(t, "the rejection", func(s Stats) bool { return s.AddressErrors >= 1 })
	if got := sourcePods(b.WaitApply(t), "batch"); got != "[10.244.0.12]" {
		t.Errorf("the policy in force applied with batch's pods %s", got)
	}
	f := pods.followed()
	if last := f[len(f)-1]; !slices.Equal(last, []string{"batch"}) {
		t.Errorf("the source follows %v after the rejection, want the rules in force", f)
	}
}
