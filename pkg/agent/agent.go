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
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
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
	// driftCheckTimeout bounds one drift check, which holds up the loop while it runs (an
	// iptables listing may wait for the xtables lock); a check that times out is tried again at
	// the next tick. A check takes milliseconds; the bound is for a stuck tool.
	driftCheckTimeout = 5 * time.Second
	// shutdownTimeout bounds how long in-flight health requests may delay the exit.
	shutdownTimeout = 5 * time.Second
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
	Displace []Displaced
	// Addresses, when set, checks the masquerade addresses of every configuration against the
	// node's (see AddressChecker), whatever the backend: a configuration whose address the
	// node lacks is rejected as a bad one is, and the policy in force keeps its address when it
	// goes away (the last good state) while /readyz fails and Stats.MissingAddresses says so.
	Addresses AddressChecker
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

// Displaced is a backend whose state the agent removes (see Options.Displace).
type Displaced interface {
	Name() string
	// Cleanup removes everything the backend installed; absent state is not an error.
	Cleanup(ctx context.Context) error
}

// Stats are the agent's counters, for logs, tests and metrics (which read them at scrape time).
//
// A reload is one load of the configuration: at startup, after a change, at each resync and
// retry, and after a datapath event. Every reload of a configuration that could be read whole
// counts once, in Reloads, ReloadApplyErrors or ConfigErrors.
type Stats struct {
	// Applies counts successful applies; ApplyErrors failed ones. A bad file at a resync still
	// re-applies the last good policy, so applies and reloads differ.
	Applies, ApplyErrors uint64
	// Reloads counts reloads whose valid configuration is now in the datapath (applied, or
	// already in place); ReloadApplyErrors those whose valid configuration could not be applied.
	Reloads, ReloadApplyErrors uint64
	// ConfigErrors counts reloads that found a configuration that does not parse or validate.
	ConfigErrors uint64
	// AddressErrors counts reloads that found a configuration naming a masquerade address the
	// node does not have (rejected as well, but counted apart: the file may be right).
	AddressErrors uint64
	// MissingAddresses are the masquerade addresses that the configuration the last reload
	// found, or the one in force, names and the node does not have. Nil when there are none.
	MissingAddresses []netip.Addr
	// LastReload is when the last reload counted in Reloads finished.
	LastReload time.Time
	// ConfigSHA256 identifies the configuration in force: the hex SHA-256 of the canonical form
	// (config.Config.Canonical) of the configuration whose policy the datapath last took in
	// full. Empty before the first.
	ConfigSHA256 string
	// LastApply is when the last successful apply finished.
	LastApply time.Time
	// Heals counts, by kind of drift (datapath.DriftChain, ...), the repairs of damage done
	// behind the agent's back: each kind a drift check (or the check before a resync) found and
	// the next apply repaired. Nil until the first heal.
	Heals map[string]uint64
	// Ready is true once a configuration is in the datapath.
	Ready bool
	// Unenforced are the kinds of drift no apply repairs (datapath.Repairable) that the last
	// drift check found: while there are any, the policy is not enforced everywhere and
	// /readyz fails. Nil when there are none.
	Unenforced []string
	// Persisting are the kinds of drift that the last apply meant to repair them did not (the
	// next check tries again): something keeps changing the datapath. Nil when there are none.
	Persisting []string
	// Rejected says why the configuration the last reload found was rejected (it does not
	// parse or validate, or names a masquerade address the node lacks), so that an older one, or
	// none, is in force: the first problems, bounded (the log has them all). Empty once a reload
	// finds a good one.
	Rejected string
	// NotReady says why /readyz fails; empty while it answers 200.
	NotReady string
	// ConfigRevision is the revision of the object the configuration in force was read from,
	// RejectedRevision that of the rejected one (Rejected), for sources that read versioned
	// objects (config.Revisioned); zero otherwise.
	ConfigRevision, RejectedRevision config.Revision
}

// maxRejectedLines bounds Stats.Rejected: a configuration of 10k bad CIDRs has 10k problems.
const maxRejectedLines = 5

// summary is err's message cut to its first maxRejectedLines lines (one problem each).
func summary(err error) string {
	lines := strings.Split(err.Error(), "\n")
	if len(lines) <= maxRejectedLines {
		return err.Error()
	}
	return strings.Join(lines[:maxRejectedLines], "\n") + fmt.Sprintf("\n(and %d more problems)", len(lines)-maxRejectedLines)
}

// ConfigHash is what Stats.ConfigSHA256 holds for a configuration.
func ConfigHash(cfg config.Config) string {
	sum := sha256.Sum256(cfg.Canonical())
	return hex.EncodeToString(sum[:])
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

// Mux is the HTTP handler served on the metrics address; more handlers (such as /metrics) can
// be added before Run.
func (a *Agent) Mux() *http.ServeMux { return a.mux }

// paths lists what the mux serves, for the startup log: the health endpoints, and /metrics once
// the caller added it.
func (a *Agent) paths() []string {
	var out []string
	for _, p := range []string{"/metrics", "/healthz", "/readyz"} {
		if _, pattern := a.mux.Handler(&http.Request{Method: http.MethodGet, URL: &url.URL{Path: p}}); pattern != "" {
			out = append(out, p)
		}
	}
	return out
}

// Stats returns a snapshot of the counters.
func (a *Agent) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.stats
	s.Heals = maps.Clone(a.stats.Heals)
	s.Unenforced = slices.Clone(a.stats.Unenforced)
	s.Persisting = slices.Clone(a.stats.Persisting)
	_, s.NotReady = a.readiness()
	s.MissingAddresses = slices.Clone(a.stats.MissingAddresses)
	return s
}

// Run runs the reconcile loop, and serves Mux on ln when ln is not nil, until ctx is done. It
// returns nil after a shutdown through ctx; the datapath is left as it is.
func (a *Agent) Run(ctx context.Context, ln net.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	serveErr := make(chan error, 1)
	if ln != nil {
		srv := &http.Server{Handler: a.mux, ReadHeaderTimeout: 5 * time.Second,
			ErrorLog: slog.NewLogLogger(a.log.Handler(), slog.LevelWarn)}
		go func() {
			err := srv.Serve(ln)
			if errors.Is(err, http.ErrServerClosed) {
				err = nil
			} else {
				cancel() // without health endpoints the agent is invisible: stop
			}
			serveErr <- err
		}()
		defer func() {
			sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
			defer scancel()
			_ = srv.Shutdown(sctx)
		}()
		a.log.Info("serving HTTP endpoints", "address", ln.Addr().String(), "paths", a.paths())
	} else {
		serveErr <- nil
	}
	loopErr := a.loop(ctx)
	cancel()
	var err error
	select {
	case err = <-serveErr:
	default:
	}
	if err != nil {
		return fmt.Errorf("serve health endpoints: %w", err)
	}
	return loopErr
}

// trigger says why the loop reconciles, for logs.
type trigger string

const (
	triggerStartup trigger = "startup"
	triggerChange  trigger = "config-change"
	triggerResync  trigger = "resync"
	triggerRetry   trigger = "retry"
	triggerEvent   trigger = "datapath-event"
	triggerDrift   trigger = "drift"
	// triggerAddress: the uplinks' addresses changed while the configuration names
	// masquerade addresses.
	triggerAddress trigger = "address-change"
)

// reapplies tells whether the trigger applies the last good policy again whatever the
// configuration holds, as drift repair: a configuration that cannot be read, or is bad, does
// not hold it up.
func (t trigger) reapplies() bool {
	return t == triggerResync || t == triggerRetry || t == triggerEvent
}

// loopState is owned by the loop goroutine.
type loopState struct {
	// desired is the policy of the last good configuration, nil before there was one;
	// desiredHash is that configuration's ConfigHash, or unhashed the configuration while its
	// hash waits for the apply (see hash).
	desired     *policy.Policy
	desiredHash string
	unhashed    *config.Config
	// desiredRevision is the revision of the object desired was read from (config.Revisioned).
	desiredRevision config.Revision
	// applied is the policy the backend last applied successfully.
	applied *policy.Policy
	// backoff is the delay before the retry of a failed apply, zero while none failed.
	backoff time.Duration
	// resync is the interval of the last good configuration.
	resync time.Duration
	// displaced counts the Options.Displace entries already removed (they are removed in order).
	displaced int
	// drift holds the kinds of drift found and not repaired yet, with when each was found.
	drift map[string]time.Time
	// persisting is the drift an apply did not repair, as last logged; checkFailing is set
	// while drift checks fail. Both keep the log to one line per change.
	persisting   string
	checkFailing bool
	// addresses tells that the configuration the last reload found, or the one in force, names
	// masquerade addresses: only then does a change of the uplinks' addresses call for a reload.
	addresses bool
	// The timers of the resync and of the retry of a failed apply.
	resyncTimer, retryTimer *time.Timer
}

// failing tells whether the desired policy could not be applied and awaits its retry.
func (st *loopState) failing() bool { return st.backoff > 0 }

func (a *Agent) loop(ctx context.Context) error {
	log := a.log.With("config", a.opts.Source.String(), "backend", a.opts.Backend.Name())
	watchCtx, stopWatching := context.WithCancel(ctx)
	changes, err := a.opts.Source.Watch(watchCtx)
	if err != nil {
		stopWatching()
		return err
	}
	defer func() {
		stopWatching()
		for range changes { // closed once the source has stopped
		}
	}()
	st := &loopState{resync: config.Default(config.Options{}).ResyncInterval,
		resyncTimer: time.NewTimer(time.Hour), retryTimer: time.NewTimer(time.Hour)}
	st.retryTimer.Stop()
	defer st.resyncTimer.Stop()
	defer st.retryTimer.Stop()
	var driftTick <-chan time.Time
	if _, ok := a.opts.Backend.(datapath.DriftChecker); ok && a.opts.DriftInterval > 0 {
		t := time.NewTicker(a.opts.DriftInterval)
		defer t.Stop()
		driftTick = t.C
	}
	w := waiter{changes: changes, events: a.opts.Changes, driftTick: driftTick}
	if a.opts.Addresses != nil {
		w.addrs = a.opts.Addresses.Changes()
	}
	for why := triggerStartup; ; {
		a.act(ctx, st, why, log.With("trigger", string(why)))
		var ok bool
		if why, ok = a.next(ctx, st, &w, log); !ok {
			log.Info("shutting down; the datapath stays in place")
			return nil
		}
	}
}

// act does what the trigger calls for, then sets the retry and resync timers for what follows.
func (a *Agent) act(ctx context.Context, st *loopState, why trigger, log *slog.Logger) {
	interval := st.resync
	if why == triggerDrift {
		// The configuration is not loaded again: the last good policy is what must be in place.
		_ = a.apply(ctx, st, log, false)
	} else {
		a.reconcile(ctx, st, why, log)
	}
	if st.failing() {
		st.retryTimer.Reset(st.backoff)
	} else {
		st.retryTimer.Stop()
	}
	// Only a resync (or a new interval) restarts the resync clock: a configuration that keeps
	// changing must not postpone the drift repair forever.
	if why == triggerStartup || why == triggerResync || st.resync != interval {
		st.resyncTimer.Reset(st.resync)
	}
}

// waiter holds the channels the loop waits on besides its timers; a closed one is set to nil.
type waiter struct {
	changes   <-chan struct{}
	events    <-chan string
	driftTick <-chan time.Time
	addrs     <-chan string
}

// next waits for the next trigger; it returns false once ctx is done.
func (a *Agent) next(ctx context.Context, st *loopState, w *waiter, log *slog.Logger) (trigger, bool) {
	for {
		select {
		case <-ctx.Done():
			return "", false
		case _, ok := <-w.changes:
			if !ok {
				w.changes = nil
				continue
			}
			return triggerChange, true
		case <-st.resyncTimer.C:
			a.checkDrift(ctx, st, log) // so that what the resync repairs counts as healed
			return triggerResync, true
		case <-w.driftTick:
			if a.checkDrift(ctx, st, log) {
				return triggerDrift, true
			}
		case <-st.retryTimer.C:
			return triggerRetry, true
		case why, ok := <-w.events:
			if !ok {
				w.events = nil // closed: no more events
				continue
			}
			log.Info("datapath event; re-applying", "event", why)
			return triggerEvent, true
		case why, ok := <-w.addrs:
			if !ok {
				w.addrs = nil
				continue
			}
			if !st.addresses {
				continue // no masquerade address to check again
			}
			log.Info("the uplinks' addresses changed; checking the masquerade addresses again", "event", why)
			return triggerAddress, true
		}
	}
}

// reconcile loads the configuration and, when it is good, applies its policy (see accept). A bad
// configuration changes nothing: the last good policy stays (and a resync re-applies it). One
// that cannot be read whole yet is loaded again when the source reports it settled.
func (a *Agent) reconcile(ctx context.Context, st *loopState, why trigger, log *slog.Logger) {
	cfg, err := a.opts.Source.Load()
	switch {
	case errors.Is(err, config.ErrUnsettled), errors.Is(err, config.ErrUnavailable):
		if errors.Is(err, config.ErrUnavailable) {
			a.unavailable(err)
		}
		if st.desired != nil && why.reapplies() {
			_ = a.apply(ctx, st, log, false) // the drift repair does not wait for the configuration
		}
	case err != nil:
		a.reject(ctx, st, why, err, log, &a.stats.ConfigErrors)
	default:
		a.accept(ctx, st, why, cfg, log)
	}
}

// unavailable records why no configuration could be read yet, for /readyz (the source logs it).
func (a *Agent) unavailable(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.stats.Ready {
		a.notReady = err.Error()
	}
}

// revision is the revision of what the source's last Load read (config.Revisioned).
func (a *Agent) revision() config.Revision {
	if r, ok := a.opts.Source.(config.Revisioned); ok {
		return r.Revision()
	}
	return config.Revision{}
}

// reject counts a configuration that does not parse or validate (in count: Stats.ConfigErrors),
// or names a masquerade address the node lacks (Stats.AddressErrors), and keeps the last good
// one.
func (a *Agent) reject(ctx context.Context, st *loopState, why trigger, err error, log *slog.Logger, count *uint64) {
	a.mu.Lock()
	*count++
	a.stats.Rejected, a.stats.RejectedRevision = summary(err), a.revision()
	if !a.stats.Ready {
		a.notReady = "no valid configuration yet: " + err.Error()
	}
	a.mu.Unlock()
	if st.desired == nil {
		log.Error("config rejected; nothing applied, not ready until a valid configuration arrives",
			"path", a.opts.Source.String(), "error", err)
		return
	}
	log.Error("config rejected; the last good configuration stays in force",
		"path", a.opts.Source.String(), "error", err)
	if why.reapplies() {
		_ = a.apply(ctx, st, log, false) // counted as an apply, not as a reload of this configuration
	}
}

// accept makes a good configuration the desired one and applies its policy. A change applies
// only a policy that differs from the one in place; a resync or retry always applies, which
// heals drift.
func (a *Agent) accept(ctx context.Context, st *loopState, why trigger, cfg config.Config, log *slog.Logger) {
	p := policy.Compile(cfg, a.opts.PolicyOptions)
	changed := st.desired != nil && !p.Equal(st.desired)
	if !changed && st.desired != nil {
		// The same policy: hand the backend the object it already knows, so that it can tell a
		// re-apply (which also repairs drift) from a new policy without comparing them again.
		p = st.desired
	}
	if err := a.checkAddresses(ctx, st, p, log); err != nil && p != st.desired {
		a.reject(ctx, st, why, err, log, &a.stats.AddressErrors)
		return
	}
	st.resync = cfg.ResyncInterval
	rev := a.revision()
	a.mu.Lock()
	a.stats.Rejected, a.stats.RejectedRevision = "", config.Revision{}
	a.mu.Unlock()
	if (why == triggerChange || why == triggerAddress) && !st.failing() && p.Equal(st.applied) {
		log.Debug("config unchanged; nothing to apply")
		// The datapath implements this configuration too (it may differ in settings that do
		// not reach the datapath, such as resyncInterval): it is the one in force now.
		hash := ConfigHash(cfg)
		st.desiredHash, st.unhashed, st.desiredRevision = hash, nil, rev
		a.reloaded(hash, rev)
		return
	}
	if changed {
		log.Info("config changed", "path", a.opts.Source.String())
	}
	st.desired, st.desiredHash, st.unhashed, st.desiredRevision = p, "", &cfg, rev
	_ = a.apply(ctx, st, log, true)
}

// checkAddresses checks the masquerade addresses of p, the policy of the configuration a reload
// found, against the node's, and those of the policy in force as well when p is another one
// that fails; it returns p's error. The policy in force keeps its addresses when they go away
// (the last good state): what is missing shows in Stats.MissingAddresses, and while the policy
// in force lacks one /readyz fails and the log says so once.
func (a *Agent) checkAddresses(ctx context.Context, st *loopState, p *policy.Policy, log *slog.Logger) error {
	names := len(p.Addresses()) > 0
	inForceNames := st.desired != nil && len(st.desired.Addresses()) > 0
	var err, inForce error
	if a.opts.Addresses != nil && (names || inForceNames) {
		err = a.opts.Addresses.Check(ctx, p)
		switch {
		case p == st.desired:
			inForce = err
		case err != nil && st.desired != nil:
			inForce = a.opts.Addresses.Check(ctx, st.desired)
		}
	}
	// A change of the uplinks' addresses matters while p names some (in force or waiting for
	// them), or p is rejected and the policy in force names some.
	st.addresses = names || err != nil && inForceNames
	missing := slices.SortedFunc(slices.Values(append(missingAddresses(err), missingAddresses(inForce)...)), netip.Addr.Compare)
	gone := ""
	if inForce != nil {
		gone = inForce.Error()
	}
	a.mu.Lock()
	was := a.addrGone
	a.addrGone, a.stats.MissingAddresses = gone, slices.Compact(missing)
	a.mu.Unlock()
	switch {
	case gone != "" && gone != was:
		log.Error("a masquerade address of the configuration in force is not on the node; its policy stays in place, "+
			"and traffic masqueraded to the address gets no replies until it is back; not ready while it lasts", "error", inForce)
	case gone == "" && was != "":
		log.Info("the masquerade addresses of the configuration in force are on the node again")
	}
	return err
}

// missingAddresses are the addresses an AddressChecker's error says the node lacks.
func missingAddresses(err error) []netip.Addr {
	if m, ok := errors.AsType[interface {
		error
		MissingAddresses() []netip.Addr
	}](err); ok {
		return m.MissingAddresses()
	}
	return nil
}

// reloaded counts a reload whose configuration, of the given hash and revision, is in force
// already.
func (a *Agent) reloaded(hash string, rev config.Revision) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stats.Reloads++
	a.stats.LastReload = time.Now()
	a.stats.ConfigSHA256, a.stats.ConfigRevision = hash, rev
}

// apply applies the desired policy and records the outcome, as a reload of the configuration
// too when reload is set: in the same update as the configuration hash, so that a scrape never
// sees the new configuration in force without its reload counted. It returns the backend's
// error; a cancelled context (shutdown) records nothing.
func (a *Agent) apply(ctx context.Context, st *loopState, log *slog.Logger, reload bool) error {
	p := st.desired
	start := time.Now()
	err := a.opts.Backend.Apply(ctx, p)
	took := time.Since(start)
	if err != nil && ctx.Err() != nil {
		return err // shutting down: the datapath stays as it is
	}
	a.opts.Observer.ObserveApply(took, err)
	if err != nil {
		a.applyFailed(st, err, log, reload)
		return err
	}
	changed := !p.Equal(st.applied)
	st.applied, st.backoff = p, 0
	hash := st.hash()
	a.mu.Lock()
	a.stats.Applies++
	a.stats.LastApply = time.Now()
	a.stats.ConfigSHA256, a.stats.ConfigRevision = hash, st.desiredRevision
	if reload {
		a.stats.Reloads++
		a.stats.LastReload = a.stats.LastApply
	}
	first := !a.stats.Ready
	a.stats.Ready, a.notReady = true, ""
	a.mu.Unlock()
	level := slog.LevelDebug
	if changed || first {
		level = slog.LevelInfo
	}
	log.Log(ctx, level, "policy applied", "ipv4Rules", len(p.IPv4), "ipv6Rules", len(p.IPv6),
		"ipv6", p.Enabled(policy.IPv6), "took", took)
	if len(st.drift) > 0 {
		a.settleDrift(ctx, st, log)
	}
	a.displace(ctx, st, log)
	return nil
}

// hash is desiredHash, computed once the configuration's policy is applied: the hash of 100k
// CIDRs costs milliseconds the datapath need not wait for.
func (st *loopState) hash() string {
	if st.unhashed != nil {
		st.desiredHash, st.unhashed = ConfigHash(*st.unhashed), nil
	}
	return st.desiredHash
}

// applyFailed records a failed apply (of a reload when reload is set) and backs off its retry.
func (a *Agent) applyFailed(st *loopState, err error, log *slog.Logger, reload bool) {
	st.backoff = min(max(2*st.backoff, a.opts.RetryMin), a.opts.RetryMax)
	a.mu.Lock()
	a.stats.ApplyErrors++
	if reload {
		a.stats.ReloadApplyErrors++
	}
	if !a.stats.Ready {
		a.notReady = "apply failed: " + err.Error()
	}
	a.mu.Unlock()
	log.Error("apply failed; retrying", "error", err, "retryIn", st.backoff)
}

// checkDrift asks the backend whether what it installed is still in place and records what
// drifted, for the apply that repairs it to count. It tells whether an apply is needed. Nothing
// is checked before the first successful apply, nor while a failed one awaits its retry.
func (a *Agent) checkDrift(ctx context.Context, st *loopState, log *slog.Logger) bool {
	checker, ok := a.opts.Backend.(datapath.DriftChecker)
	if !ok || st.applied == nil || st.failing() {
		return false
	}
	cctx, cancel := context.WithTimeout(ctx, driftCheckTimeout)
	kinds, err := checker.CheckDrift(cctx)
	cancel()
	if err != nil {
		if ctx.Err() == nil && !st.checkFailing {
			log.Warn("drift check failed; trying again at the next one", "error", err)
		}
		st.checkFailing = true
		return false
	}
	if st.checkFailing {
		log.Info("drift check works again")
		st.checkFailing = false
	}
	kinds = a.unenforced(kinds, log)
	if len(kinds) == 0 {
		a.healed(st, nil, log) // repaired by an earlier apply whose own check failed
		a.mu.Lock()
		a.stats.Persisting = nil
		a.mu.Unlock()
		st.persisting = ""
		return false
	}
	now := time.Now()
	if st.drift == nil {
		st.drift = map[string]time.Time{}
	}
	for _, k := range kinds {
		if _, ok := st.drift[k]; !ok {
			st.drift[k] = now
		}
	}
	return true
}

// settleDrift runs after an apply while drift was pending: it checks again and counts as healed
// every kind that is in place now. A kind still drifted is logged (once while it persists) and
// left for the next check to try again.
func (a *Agent) settleDrift(ctx context.Context, st *loopState, log *slog.Logger) {
	checker, ok := a.opts.Backend.(datapath.DriftChecker)
	if !ok {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, driftCheckTimeout)
	left, err := checker.CheckDrift(cctx)
	cancel()
	if err != nil {
		return // the next check tells
	}
	left = a.unenforced(left, log)
	a.healed(st, left, log)
	a.mu.Lock()
	a.stats.Persisting = slices.Clone(left)
	a.mu.Unlock()
	if len(left) == 0 {
		st.persisting = ""
		return
	}
	if s := strings.Join(left, ","); s != st.persisting {
		log.Warn("drift persists after re-applying; trying again at the next check", "what", left)
		st.persisting = s
	}
}

// unenforced records the kinds of drift no apply repairs (datapath.Repairable) among those a
// check found, logs when they change, and returns the others, which an apply repairs.
func (a *Agent) unenforced(kinds []string, log *slog.Logger) []string {
	var repairable, left []string
	for _, k := range kinds {
		if datapath.Repairable(k) {
			repairable = append(repairable, k)
		} else {
			left = append(left, k)
		}
	}
	a.mu.Lock()
	was := a.stats.Unenforced
	a.stats.Unenforced = left
	a.mu.Unlock()
	switch {
	case slices.Equal(was, left):
	case len(left) > 0:
		log.Warn("the policy is not enforced everywhere, and no apply can repair it (the backend's log says where); not ready while it lasts",
			"what", left)
	default:
		log.Info("the policy is enforced everywhere again", "was", was)
	}
	return repairable
}

// healed counts and logs, once each, the pending kinds of drift that are not in left.
func (a *Agent) healed(st *loopState, left []string, log *slog.Logger) {
	for _, k := range slices.Sorted(maps.Keys(st.drift)) {
		if slices.Contains(left, k) {
			continue
		}
		a.mu.Lock()
		if a.stats.Heals == nil {
			a.stats.Heals = map[string]uint64{}
		}
		a.stats.Heals[k]++
		a.mu.Unlock()
		log.Warn("drift healed: restored what was changed behind the agent's back", "what", k,
			"took", time.Since(st.drift[k]).Round(time.Millisecond))
		delete(st.drift, k)
	}
}

// displace removes the other backends' state, once (see Options.Displace).
func (a *Agent) displace(ctx context.Context, st *loopState, log *slog.Logger) {
	for st.displaced < len(a.opts.Displace) {
		d := a.opts.Displace[st.displaced]
		if err := d.Cleanup(ctx); err != nil {
			log.Warn("cannot remove the other backend's state; retrying after the next apply",
				"other", d.Name(), "error", err)
			return
		}
		log.Info("the other backend's state is removed (backends are exclusive)", "other", d.Name())
		st.displaced++
		if st.displaced == len(a.opts.Displace) {
			// One line for the end, so a reader need not know how many others there are.
			log.Info("no other backend's state is left on the node", "others", len(a.opts.Displace))
		}
	}
}

func (a *Agent) healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "ok")
}

// readiness tells whether /readyz answers 200, and if not why; a.mu held.
func (a *Agent) readiness() (bool, string) {
	switch {
	case !a.stats.Ready:
		return false, a.notReady
	case len(a.stats.Unenforced) > 0:
		return false, "the policy is not enforced everywhere: " + strings.Join(a.stats.Unenforced, ", ") + " (see the log)"
	case a.addrGone != "":
		return false, "a masquerade address of the configuration in force is not on the node: " + a.addrGone
	}
	return true, ""
}

func (a *Agent) readyz(w http.ResponseWriter, _ *http.Request) {
	a.mu.Lock()
	ready, why := a.readiness()
	a.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if !ready {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "not ready:", why)
		return
	}
	fmt.Fprintln(w, "ok")
}
