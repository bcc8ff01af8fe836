package agent

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// fakeAddresses is an AddressChecker over a set of node addresses that tests change.
type fakeAddresses struct {
	mu      sync.Mutex
	have    map[netip.Addr]bool
	checks  int
	changes chan string
}

func newFakeAddresses(have ...string) *fakeAddresses {
	f := &fakeAddresses{have: map[netip.Addr]bool{}, changes: make(chan string, 1)}
	for _, a := range have {
		f.have[netip.MustParseAddr(a)] = true
	}
	return f
}

// set adds (or removes) an address and reports the change, as an uplink watch would.
func (f *fakeAddresses) set(addr string, on bool) {
	f.mu.Lock()
	f.have[netip.MustParseAddr(addr)] = on
	f.mu.Unlock()
	f.changes <- fmt.Sprintf("uplink address %s: %v", addr, on)
}

func (f *fakeAddresses) Changes() <-chan string { return f.changes }

func (f *fakeAddresses) Check(_ context.Context, p *policy.Policy) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.checks++
	var missing fakeMissing
	for _, u := range p.Addresses() {
		if !f.have[u.Addr] {
			missing = append(missing, u)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return missing
}

type fakeMissing []policy.AddressUse

func (m fakeMissing) Error() string {
	return fmt.Sprintf("%v not on the uplinks", []policy.AddressUse(m))
}

func (m fakeMissing) MissingAddresses() []netip.Addr {
	var out []netip.Addr
	for _, u := range m {
		out = append(out, u.Addr)
	}
	return out
}

func withAddresses(f *fakeAddresses) func(*Options) { return func(o *Options) { o.Addresses = f } }

func outboundAddress(p *policy.Policy) netip.Addr {
	_, r := p.OutboundAction(policy.IPv4)
	return r.Address
}

// TestMasqueradeAddressMissingAtStartup: a configuration whose masquerade address the node lacks
// applies nothing, the agent is not ready and says why; once the address is there, it applies.
func TestMasqueradeAddressMissingAtStartup(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	writeFile(t, path, "masqueradeAddress: 10.0.0.11\n")
	addrs := newFakeAddresses("10.0.0.10")
	b := &datapathtest.Backend{}
	r := startAgent(t, path, b, withAddresses(addrs))
	s := r.waitStats(t, "the rejection", func(s Stats) bool { return s.AddressErrors == 1 })
	if !slices.Equal(s.MissingAddresses, []netip.Addr{netip.MustParseAddr("10.0.0.11")}) || s.ConfigErrors != 0 {
		t.Errorf("stats %+v, want 10.0.0.11 missing and no config error", s)
	}
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "10.0.0.11") {
		t.Errorf("/readyz %d %q, want 503 naming the address", code, body)
	}
	b.NoApply(t, 50*time.Millisecond)

	addrs.set("10.0.0.11", true)
	if got := outboundAddress(b.WaitApply(t)); got != netip.MustParseAddr("10.0.0.11") {
		t.Errorf("applied the outbound rule from %v", got)
	}
	r.waitReady(t)
	if s := r.agent.Stats(); s.MissingAddresses != nil {
		t.Errorf("missing addresses %v once they are there", s.MissingAddresses)
	}
}

// TestMasqueradeAddressGoesAway: the address of the policy in force going away keeps that policy
// (the last good state), fails /readyz naming it and shows in the stats, logged once; a new
// configuration with another missing address is rejected meanwhile; its return makes the agent
// ready again, and so does a configuration without it.
func TestMasqueradeAddressGoesAway(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("masqueradeAddress: 10.0.0.11\nresyncInterval: 1h\n")
	addrs := newFakeAddresses("10.0.0.10", "10.0.0.11")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b, withAddresses(addrs))
	b.WaitApply(t)
	r.waitReady(t)

	addrs.set("10.0.0.11", false)
	r.waitStats(t, "the address gone", func(s Stats) bool { return len(s.MissingAddresses) == 1 })
	b.NoApply(t, 50*time.Millisecond) // the policy in force stays as it is
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "10.0.0.11") {
		t.Errorf("/readyz %d %q, want 503 naming the address", code, body)
	}
	addrs.set("10.0.0.10", true) // another change while it lasts: no second log line
	r.waitStats(t, "the next check", func(s Stats) bool { return s.Reloads >= 3 })

	cm.write("masqueradeAddress: 10.0.0.12\nresyncInterval: 1h\n")
	s := r.waitStats(t, "the rejection", func(s Stats) bool { return s.AddressErrors == 1 })
	if got := fmt.Sprint(s.MissingAddresses); got != "[10.0.0.11 10.0.0.12]" {
		t.Errorf("missing %s, want both the address in force and the new one", got)
	}
	b.NoApply(t, 50*time.Millisecond)
	if n := strings.Count(r.log.String(), "a masquerade address of the configuration in force is not on the node"); n != 1 {
		t.Errorf("%d log lines about the address gone, want 1", n)
	}

	addrs.set("10.0.0.12", true) // the rejected configuration can apply now
	if got := outboundAddress(b.WaitApply(t)); got != netip.MustParseAddr("10.0.0.12") {
		t.Errorf("applied the outbound rule from %v, want 10.0.0.12", got)
	}
	r.waitReady(t)
	r.waitLog(t, "the masquerade addresses of the configuration in force are on the node again")

	cm.write("resyncInterval: 1h\n")
	if got := outboundAddress(b.WaitApply(t)); got.IsValid() {
		t.Errorf("applied the outbound rule from %v, want the uplink's address", got)
	}
	// Without masquerade addresses, the uplinks' changes call for no reload.
	reloads := r.agent.Stats().Reloads
	addrs.set("10.0.0.12", false)
	b.NoApply(t, 100*time.Millisecond)
	if s := r.agent.Stats(); s.Reloads != reloads || s.MissingAddresses != nil {
		t.Errorf("an address change without masquerade addresses: stats %+v, want no reload", s)
	}
}
