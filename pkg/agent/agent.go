// Package agent is the ip-masq-agent daemon: one reconcile loop that turns the configuration
// into one Apply on the datapath backend, and the health endpoints.
//
// Everything that can change the datapath goes through the loop: a change of the configuration
// (as its config.Source reports it), the periodic resync (which re-applies and so heals drift), the drift
// check (every second, for backends that can tell cheaply what was changed behind the agent's
// back), datapath events, and the retry of a failed apply. Shutdown stops the loop and leaves
// the datapath in place, so that pods keep working while the agent is restarted or upgraded.
package agent

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Defaults of Options.
const (
	DefaultRetryMin = 500 * time.Millisecond
	DefaultRetryMax = 30 * time.Second
	// DefaultDriftInterval is the interval of the drift checks the command line asks for by
	// default: a repair follows within about a second of the damage, at a cost the backends
	// keep small (see datapath.DriftChecker).
	DefaultDriftInterval = time.Second
)

// Options configure an Agent.
type Options struct {
	// Source is where the configuration comes from (configwatch.File for a file).
	Source        config.Source
	PolicyOptions policy.Options
	Backend       datapath.Backend
	// Logger receives the agent's logs; nil discards them.
	Logger *slog.Logger
	// Observer, when set, is told of every apply as it happens (pkg/metrics records them).
	Observer Observer
	// RetryMin and RetryMax bound the exponential backoff of a failed apply.
	RetryMin, RetryMax time.Duration
	// DriftInterval is how often the loop asks a backend that implements
	// datapath.DriftChecker whether what it installed is still in place, and applies again when
	// not; zero or less turns the checks off (the resync still repairs drift). Every heal, found
	// by a check or by the check before a resync, is counted by kind in Stats.Heals and logged
	// once.
	DriftInterval time.Duration
	// Changes, when set, carries events from outside the configuration that the datapath must
	// follow (such as an uplink address change, reported by a backend); each value, a short
	// reason for the logs, makes the loop load the configuration and re-apply, as a resync does.
	Changes <-chan string
	// Displace are the other backends, whose state is removed once Backend holds a policy (after
	// the first successful apply, so that the node is never without a datapath, and never while
	// only a bad configuration is at hand). A failed removal is logged and retried after the
	// next successful apply.
	Displace []datapath.Displaced
	// Addresses, when set, checks the masquerade addresses of every configuration against the
	// node's (see AddressChecker), whatever the backend: a configuration whose address the
	// node lacks is rejected as a bad one is, and the policy in force keeps its address when it
	// goes away (the last good state) while /readyz fails and Stats.MissingAddresses says so.
	Addresses AddressChecker
	// Pods, when set, tells which of the node's pods the selector rules of a configuration
	// choose (config.SourceRule.Selects): their addresses reach the policy, and a change of
	// them makes the loop load the configuration and apply, as an address change does. It
	// follows the rules of the configuration being applied, and of none when it has none. While
	// it cannot tell yet, such a configuration waits and the one in force stays. Without Pods
	// a configuration whose rules select pods is rejected, with NoPods as the hint.
	Pods PodSource
	// NoPods says why there is no Pods and how to run the agent with it, for that rejection.
	NoPods string
}

// PodSource tells which of the node's pods selector rules choose (pkg/podsource).
type PodSource interface {
	// Watch starts the source; the channel receives a value whenever the pods the rules of the
	// last Select choose changed, and once they are first known, and is closed once the source
	// has stopped, after ctx is done. Watch is called once, before Select.
	Watch(ctx context.Context) (<-chan struct{}, error)
	// Select makes the selector rules among rules the ones followed (none: follow nothing)
	// and returns, by rule name, the addresses of the pods each chooses now, and when the
	// first event that changed them since the last Select arrived (zero for none). It returns an
	// error while it cannot tell yet; the channel reports when it can.
	Select(rules []config.SourceRule) (map[string][]netip.Addr, time.Time, error)
}

// AddressChecker tells whether the masquerade addresses of a policy are the node's own
// (pkg/nodeaddr).
type AddressChecker interface {
	// Check returns nil when every masquerade address of p (policy.Policy.Addresses) is an
	// address of the node's uplinks. Otherwise its error names each address that is not, and
	// implements MissingAddresses() []netip.Addr, unless the check could not be made at all.
	Check(ctx context.Context, p *policy.Policy) error
	// Changes receives a short reason whenever the uplinks' addresses changed: an address may
	// have gone away or come back. The loop then loads the configuration again, as for a
	// datapath event, when the configuration names masquerade addresses.
	Changes() <-chan string
}

// Observer is told of the loop's work as it happens (see Options.Observer).
type Observer interface {
	// ObserveApply follows every apply of the policy, except one cut short by a shutdown: how
	// long it took, and its error (nil when it succeeded).
	ObserveApply(took time.Duration, err error)
}

// PodsObserver, when the Observer implements it, is told how long each change of the pods the
// selector rules choose took to reach the datapath: from the event of the API server's watch
// that changed them to the end of the apply that put them in place.
type PodsObserver interface {
	ObservePodsApplied(took time.Duration)
}

// Agent is the daemon. Create it with New, add handlers to Mux if needed, then Run it.
type Agent struct {
	opts Options
	log  *slog.Logger
	mux  *http.ServeMux

	mu       sync.Mutex
	stats    Stats
	notReady string // why /readyz fails, while not ready
	// addrGone says which masquerade address of the policy in force the node lacks; /readyz
	// fails while it is set.
	addrGone string
	// inForce is the configuration in force (Stats.ConfigSHA256's), nil before the first.
	inForce *config.Config
	// inForcePods are the pods the source rules of the policy in force select (see Applied).
	inForcePods map[string][]netip.Addr
}

// New checks the options and returns an agent; it touches neither the configuration nor the
// datapath.
func New(opts Options) (*Agent, error) {
	if opts.Backend == nil {
		return nil, errors.New("agent: no datapath backend")
	}
	if opts.Source == nil {
		return nil, errors.New("agent: no configuration source")
	}
	if opts.RetryMin <= 0 {
		opts.RetryMin = DefaultRetryMin
	}
	if opts.RetryMax < opts.RetryMin {
		opts.RetryMax = max(DefaultRetryMax, opts.RetryMin)
	}
	if opts.Observer == nil {
		opts.Observer = noObserver{}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Agent{opts: opts, log: log.With("component", "agent"), mux: http.NewServeMux(),
		notReady: "the first configuration is not applied yet"}
	a.mux.HandleFunc("GET /healthz", a.healthz)
	a.mux.HandleFunc("GET /readyz", a.readyz)
	return a, nil
}

type noObserver struct{}

func (noObserver) ObserveApply(time.Duration, error) {}
