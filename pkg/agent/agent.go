// Package agent is the ip-masq-agent daemon: one reconcile loop that turns the configuration
// file into one Apply on the datapath backend, and the health endpoints.
//
// Everything that can change the datapath goes through the loop: a change in the config
// directory (debounced), the periodic resync (which re-applies and so heals drift), the drift
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
	"net/url"
	"path/filepath"
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
	// DefaultDebounce lets a burst of directory events (a ConfigMap swap is several) settle into
	// one reload, while keeping a change well under a second from file to datapath.
	DefaultDebounce = 20 * time.Millisecond
	// DefaultQuiet is how long a file must be unmodified before it is read as whole: a writer
	// that writes in several chunks pauses between them (see Options.Quiet).
	DefaultQuiet = 100 * time.Millisecond
	// DefaultWriterTimeout bounds the wait for a writer that keeps the file open.
	DefaultWriterTimeout = 30 * time.Second
	DefaultRetryMin      = 500 * time.Millisecond
	DefaultRetryMax      = 30 * time.Second
	// DefaultDriftInterval is how often the datapath is checked for drift: a repair follows
	// within about a second of the damage, at a cost the backends keep small (see
	// datapath.DriftChecker).
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
	// ConfigPath is the configuration file; a missing file means the defaults.
	ConfigPath    string
	ConfigOptions config.Options
	PolicyOptions policy.Options
	Backend       datapath.Backend
	// Logger receives the agent's logs; nil discards them.
	Logger *slog.Logger
	// Debounce is how long the config directory must stay quiet before the file is re-read.
	Debounce time.Duration
	// Quiet and WriterTimeout keep a file that is being written from being applied half-read.
	// A file is read as whole only when no writer has it open (a modification seen and no
	// close after it; for at most WriterTimeout since the last modification, after which the
	// writer is taken for stalled), it did not change during the read, and it was last
	// modified at least Quiet ago; otherwise it is read again shortly. A ConfigMap update
	// replaces the file whole, so it only waits out Quiet from the kubelet's write.
	Quiet, WriterTimeout time.Duration
	// RetryMin and RetryMax bound the exponential backoff of a failed apply.
	RetryMin, RetryMax time.Duration
	// DriftInterval is how often the loop asks a backend that implements
	// datapath.DriftChecker whether what it installed is still in place, and applies again when
	// not; zero means DefaultDriftInterval, a negative value turns the checks off (the resync
	// still repairs drift). Every heal, found by a check or by the check before a resync, is
	// counted by kind in Stats.Heals and logged once.
	DriftInterval time.Duration
	// Changes, when set, carries events from outside the file that the datapath must follow
	// (such as an uplink address change, reported by a backend); each value, a short reason
	// for the logs, makes the loop re-read the file and re-apply, as a resync does.
	Changes <-chan string
	// Displace are the other backends, whose state is removed once Backend holds a policy (after
	// the first successful apply, so that the node is never without a datapath, and never while
	// only a bad configuration is at hand). A failed removal is logged and retried after the
	// next successful apply.
	Displace []Displaced
}

// Displaced is a backend whose state the agent removes (see Options.Displace).
type Displaced interface {
	Name() string
	// Cleanup removes everything the backend installed; absent state is not an error.
	Cleanup(ctx context.Context) error
}

// Stats are the agent's counters, for logs, tests and metrics (which read them at scrape time).
//
// A reload is one read of the config file: at startup, after a change in its directory, at each
// resync and retry, and after a datapath event. Every reload counts once, in Reloads,
// ReloadApplyErrors or ConfigErrors.
type Stats struct {
	// Applies counts successful applies; ApplyErrors failed ones. A bad file at a resync still
	// re-applies the last good policy, so applies and reloads differ.
	Applies, ApplyErrors uint64
	// Reloads counts reloads whose valid configuration is now in the datapath (applied, or
	// already in place); ReloadApplyErrors those whose valid configuration could not be applied.
	Reloads, ReloadApplyErrors uint64
	// ConfigErrors counts reloads that found a file that does not parse or validate.
	ConfigErrors uint64
	// LastReload is when the last reload counted in Reloads finished.
	LastReload time.Time
	// ConfigSHA256 identifies the configuration in force: the hex SHA-256 of the canonical form
	// (config.Config.Canonical) of the configuration whose policy the datapath last took in
	// full. Empty before the first.
	ConfigSHA256 string
	// LastApply is when the last successful apply finished.
	LastApply time.Time
	// SyncDurations are the durations of every apply, failed ones included.
	SyncDurations DurationHistogram
	// Heals counts, by kind of drift (datapath.DriftChain, ...), the repairs of damage done
	// behind the agent's back: each kind a drift check (or the check before a resync) found and
	// the next apply repaired. Nil until the first heal.
	Heals map[string]uint64
	// Ready is true once a configuration is in the datapath.
	Ready bool
}

// numSyncBuckets is the number of buckets of SyncBuckets.
const numSyncBuckets = 14

// SyncBuckets are the upper bounds, in seconds, of DurationHistogram's buckets: from a BPF map
// update (a millisecond) to an iptables-restore of thousands of rules or one that waits for the
// xtables lock (up to its 30 s timeout).
func SyncBuckets() []float64 {
	return []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}
}

// DurationHistogram counts durations as a Prometheus histogram does.
type DurationHistogram struct {
	// Buckets[i] counts the durations of at most SyncBuckets()[i] seconds: cumulative, so the
	// last bucket holds every duration up to 30 s and Count those beyond too.
	Buckets [numSyncBuckets]uint64
	Count   uint64
	Sum     time.Duration
}

func (h *DurationHistogram) observe(d time.Duration) {
	for i, bound := range SyncBuckets() {
		if d.Seconds() <= bound {
			h.Buckets[i]++
		}
	}
	h.Count++
	h.Sum += d
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
}

// New checks the options and returns an agent; it touches neither the file nor the datapath.
func New(opts Options) (*Agent, error) {
	if opts.Backend == nil {
		return nil, errors.New("agent: no datapath backend")
	}
	if opts.ConfigPath == "" {
		return nil, errors.New("agent: no config path")
	}
	// Absolute, so that watch events and the file's resolved path compare.
	path, err := filepath.Abs(opts.ConfigPath)
	if err != nil {
		return nil, fmt.Errorf("agent: config path: %w", err)
	}
	opts.ConfigPath = path
	if opts.Debounce <= 0 {
		opts.Debounce = DefaultDebounce
	}
	if opts.Quiet <= 0 {
		opts.Quiet = DefaultQuiet
	}
	if opts.WriterTimeout <= 0 {
		opts.WriterTimeout = DefaultWriterTimeout
	}
	if opts.RetryMin <= 0 {
		opts.RetryMin = DefaultRetryMin
	}
	if opts.RetryMax < opts.RetryMin {
		opts.RetryMax = max(DefaultRetryMax, opts.RetryMin)
	}
	if opts.DriftInterval == 0 {
		opts.DriftInterval = DefaultDriftInterval
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
)

// loopState is owned by the loop goroutine.
type loopState struct {
	// desired is the policy of the last good configuration, nil before there was one;
	// desiredHash is that configuration's ConfigHash.
	desired     *policy.Policy
	desiredHash string
	// applied is the policy the backend last applied successfully.
	applied *policy.Policy
	// failed is set while desired could not be applied; backoff is the next retry delay.
	failed  bool
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
}

func (a *Agent) loop(ctx context.Context) error {
	log := a.log.With("config", a.opts.ConfigPath, "backend", a.opts.Backend.Name())
	w, err := newDirWatcher(a.opts.ConfigPath, log)
	if err != nil {
		return fmt.Errorf("watch config directory: %w", err)
	}
	defer w.close()

	st := &loopState{resync: config.Default(a.opts.ConfigOptions).ResyncInterval}
	resync := time.NewTimer(time.Hour)
	debounce := time.NewTimer(time.Hour)
	retry := time.NewTimer(time.Hour)
	settle := time.NewTimer(time.Hour) // reads again a file that was being written
	debounce.Stop()
	retry.Stop()
	settle.Stop()
	defer resync.Stop()
	defer debounce.Stop()
	defer retry.Stop()
	defer settle.Stop()

	var driftTick <-chan time.Time
	if _, ok := a.opts.Backend.(datapath.DriftChecker); ok && a.opts.DriftInterval > 0 {
		t := time.NewTicker(a.opts.DriftInterval)
		defer t.Stop()
		driftTick = t.C
	}

	changes := a.opts.Changes
	next := triggerStartup
	for {
		if next != "" {
			interval := st.resync
			if next == triggerDrift {
				// The file is not read again: the last good policy is what must be in place.
				_ = a.apply(ctx, st, log.With("trigger", string(next)), false)
			} else if again := a.reconcile(ctx, st, next, w); again > 0 {
				settle.Reset(again)
			} else {
				settle.Stop()
			}
			w.follow() // a ConfigMap update points the file at a new directory
			if st.failed {
				retry.Reset(st.backoff)
			} else {
				retry.Stop()
			}
			// Only a resync (or a new interval) restarts the resync clock: a directory that keeps
			// changing must not postpone the drift repair forever.
			if next == triggerStartup || next == triggerResync || st.resync != interval {
				resync.Reset(st.resync)
			}
			next = ""
		}
		select {
		case <-ctx.Done():
			log.Info("shutting down; the datapath stays in place")
			return nil
		case ev := <-w.events():
			if w.handle(ev) {
				log.Debug("config directory changed", "event", ev.String())
				if w.swapped(ev) {
					debounce.Stop()
					next = triggerChange
				} else {
					debounce.Reset(a.opts.Debounce)
				}
			}
		case err := <-w.errors():
			// Events may have been lost (a queue overflow): re-read to be sure.
			log.Warn("config directory watch error; re-reading the file", "error", err)
			debounce.Reset(a.opts.Debounce)
		case <-debounce.C:
			next = triggerChange
		case <-settle.C:
			next = triggerChange
		case <-resync.C:
			w.ensure()
			a.checkDrift(ctx, st, log) // so that what the resync repairs counts as healed
			next = triggerResync
		case <-driftTick:
			if a.checkDrift(ctx, st, log) {
				next = triggerDrift
			}
		case <-retry.C:
			next = triggerRetry
		case why, ok := <-changes:
			if !ok {
				changes = nil // closed: no more events
				continue
			}
			log.Info("datapath event; re-applying", "event", why)
			next = triggerEvent
		}
	}
}

// reconcile reads the file and, when it is good, applies its policy. A change reload applies only
// a policy that differs from the one in place; a resync or retry always applies, which heals
// drift. A bad file changes nothing: the last good policy stays (and a resync re-applies it).
// A file being written is not read yet: reconcile returns when to read it again.
func (a *Agent) reconcile(ctx context.Context, st *loopState, why trigger, w *dirWatcher) time.Duration {
	log := a.log.With("trigger", string(why))
	writing, lastWrite := w.writer()
	f, err := config.ReadFile(a.opts.ConfigPath)
	if err == nil {
		if again, reason := a.unsettled(f, writing, lastWrite, time.Now()); again > 0 {
			log.Debug("the config file is being written; reading it again shortly", "path", a.opts.ConfigPath,
				"reason", reason, "in", again)
			if st.desired != nil && (why == triggerResync || why == triggerRetry || why == triggerEvent) {
				_ = a.apply(ctx, st, log, false) // the drift repair does not wait for the file
			}
			return again
		}
		if writing {
			log.Warn("the config file is still open for writing but unmodified for a while; reading it as it is",
				"path", a.opts.ConfigPath, "lastWrite", lastWrite)
		}
	}
	var cfg config.Config
	if err == nil {
		cfg, err = f.Parse(a.opts.ConfigOptions)
	}
	if err != nil {
		a.mu.Lock()
		a.stats.ConfigErrors++
		if !a.stats.Ready {
			a.notReady = "no valid configuration yet: " + err.Error()
		}
		a.mu.Unlock()
		if st.desired == nil {
			log.Error("config rejected; nothing applied, not ready until a valid configuration arrives",
				"path", a.opts.ConfigPath, "error", err)
			return 0
		}
		log.Error("config rejected; the last good configuration stays in force",
			"path", a.opts.ConfigPath, "error", err)
		if why == triggerResync || why == triggerRetry || why == triggerEvent {
			_ = a.apply(ctx, st, log, false) // counted as an apply, not as a reload of this file
		}
		return 0
	}
	st.resync = cfg.ResyncInterval
	p := policy.Compile(cfg, a.opts.PolicyOptions)
	changed := st.desired != nil && !p.Equal(st.desired)
	if !changed && st.desired != nil {
		// The same policy: hand the backend the object it already knows, so that it can tell a
		// re-apply (which also repairs drift) from a new policy without comparing them again.
		p = st.desired
	}
	hash := ConfigHash(cfg)
	if why == triggerChange && !st.failed && p.Equal(st.applied) {
		log.Debug("config unchanged; nothing to apply")
		// The datapath implements this configuration too (it may differ in settings that do
		// not reach the datapath, such as resyncInterval): it is the one in force now.
		st.desiredHash = hash
		a.mu.Lock()
		a.stats.Reloads++
		a.stats.LastReload = time.Now()
		a.stats.ConfigSHA256 = hash
		a.mu.Unlock()
		return 0
	}
	if changed {
		log.Info("config changed", "path", a.opts.ConfigPath)
	}
	st.desired, st.desiredHash = p, hash
	_ = a.apply(ctx, st, log, true)
	return 0
}

// unsettled tells whether a read of the config file may have caught it half-written, and if so
// when to read it again. A missing file is settled: a ConfigMap update or an editor replaces
// the file whole, by a rename.
func (a *Agent) unsettled(f config.File, writing bool, lastWrite, now time.Time) (time.Duration, string) {
	if f.Missing {
		return 0, ""
	}
	if writing {
		if left := a.opts.WriterTimeout - now.Sub(lastWrite); left > 0 {
			// The close after the last write is an event that reads it sooner.
			return left, "a writer has it open"
		}
	}
	if f.Torn {
		return a.opts.Quiet, "it changed while it was read"
	}
	if f.Published {
		return 0, "" // a ConfigMap's files are complete before they appear
	}
	// An mtime in the future (a clock step, a copied timestamp) says nothing about writers.
	if age := now.Sub(f.ModTime); age >= 0 && age < a.opts.Quiet {
		return a.opts.Quiet - age, "it was modified " + age.Round(time.Millisecond).String() + " ago"
	}
	return 0, ""
}

// apply applies the desired policy and records the outcome, as a reload of the file too when
// reload is set: in the same update as the configuration hash, so that a scrape never sees the
// new configuration in force without its reload counted. It returns the backend's error; a
// cancelled context (shutdown) records nothing.
func (a *Agent) apply(ctx context.Context, st *loopState, log *slog.Logger, reload bool) error {
	p := st.desired
	start := time.Now()
	err := a.opts.Backend.Apply(ctx, p)
	took := time.Since(start)
	if err != nil {
		if ctx.Err() != nil {
			return err // shutting down: the datapath stays as it is
		}
		st.failed = true
		st.backoff = min(max(2*st.backoff, a.opts.RetryMin), a.opts.RetryMax)
		a.mu.Lock()
		a.stats.ApplyErrors++
		if reload {
			a.stats.ReloadApplyErrors++
		}
		a.stats.SyncDurations.observe(took)
		if !a.stats.Ready {
			a.notReady = "apply failed: " + err.Error()
		}
		a.mu.Unlock()
		log.Error("apply failed; retrying", "error", err, "retryIn", st.backoff)
		return err
	}
	changed := !p.Equal(st.applied)
	st.applied, st.failed, st.backoff = p, false, 0
	a.mu.Lock()
	a.stats.Applies++
	a.stats.LastApply = time.Now()
	a.stats.SyncDurations.observe(took)
	a.stats.ConfigSHA256 = st.desiredHash
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

// checkDrift asks the backend whether what it installed is still in place and records what
// drifted, for the apply that repairs it to count. It tells whether an apply is needed. Nothing
// is checked before the first successful apply, nor while a failed one awaits its retry.
func (a *Agent) checkDrift(ctx context.Context, st *loopState, log *slog.Logger) bool {
	checker, ok := a.opts.Backend.(datapath.DriftChecker)
	if !ok || st.applied == nil || st.failed {
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
	if len(kinds) == 0 {
		a.healed(st, nil, log) // repaired by an earlier apply whose own check failed
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
	a.healed(st, left, log)
	if len(left) == 0 {
		st.persisting = ""
		return
	}
	if s := strings.Join(left, ","); s != st.persisting {
		log.Warn("drift persists after re-applying; trying again at the next check", "what", left)
		st.persisting = s
	}
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
	}
}

func (a *Agent) healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintln(w, "ok")
}

func (a *Agent) readyz(w http.ResponseWriter, _ *http.Request) {
	a.mu.Lock()
	ready, why := a.stats.Ready, a.notReady
	a.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if !ready {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "not ready:", why)
		return
	}
	fmt.Fprintln(w, "ok")
}
