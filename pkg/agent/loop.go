package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// shutdownTimeout bounds how long in-flight health requests may delay the exit.
const shutdownTimeout = 5 * time.Second

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
	// triggerPods: the pods the configuration's selector rules choose changed (Options.Pods).
	triggerPods trigger = "pods-change"
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
	// desiredRevision is the revision of the object desired was read from (config.Revisioned),
	// desiredConfig that configuration.
	desiredRevision config.Revision
	desiredConfig   config.Config
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
	// podsSince is when the event arrived that changed the selected pods of the desired policy,
	// zero once that policy is applied (or none changed).
	podsSince time.Time
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
	var pods <-chan struct{}
	if a.opts.Pods != nil {
		if pods, err = a.opts.Pods.Watch(watchCtx); err != nil {
			stopWatching()
			for range changes {
			}
			return err
		}
	}
	defer func() {
		stopWatching()
		for range changes { // closed once the source has stopped
		}
		if pods != nil {
			for range pods {
			}
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
	w := waiter{changes: changes, events: a.opts.Changes, driftTick: driftTick, pods: pods}
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
	pods      <-chan struct{}
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
		case _, ok := <-w.pods:
			if !ok {
				w.pods = nil
				continue
			}
			return triggerPods, true
		}
	}
}
