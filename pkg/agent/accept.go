package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

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
		// The drift repair, and the pods of the policy in force, do not wait for the configuration.
		if st.desired != nil && (why == triggerPods && a.followInForce(st) || why.reapplies()) {
			_ = a.apply(ctx, st, log, false)
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

// reject counts a configuration that does not parse or validate (in count: Stats.ConfigErrors),
// or names a masquerade address the node lacks (Stats.AddressErrors), and keeps the last good
// one, with the pods its rules select now.
func (a *Agent) reject(ctx context.Context, st *loopState, why trigger, err error, log *slog.Logger, count *uint64) {
	moved := a.followInForce(st)
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
	if moved || why.reapplies() {
		_ = a.apply(ctx, st, log, false) // counted as an apply, not as a reload of this configuration
	}
}

// accept makes a good configuration the desired one and applies its policy. A change applies
// only a policy that differs from the one in place; a resync or retry always applies, which
// heals drift. A configuration that selects pods is rejected without Options.Pods, and waits
// while they are not known yet (the one in force stays).
func (a *Agent) accept(ctx context.Context, st *loopState, why trigger, cfg config.Config, log *slog.Logger) {
	popts, since, err := a.policyOptions(cfg)
	switch {
	case errors.Is(err, errPodsUnknown):
		a.unavailable(err)
		log.Info("waiting for the pods the configuration selects; the configuration in force stays until they are known", "error", err)
		if st.desired != nil && why.reapplies() {
			_ = a.apply(ctx, st, log, false)
		}
		return
	case err != nil:
		a.reject(ctx, st, why, err, log, &a.stats.ConfigErrors)
		return
	}
	p := policy.Compile(cfg, popts)
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
	if (why == triggerChange || why == triggerAddress || why == triggerPods) && !st.failing() && p.Equal(st.applied) {
		log.Debug("config unchanged; nothing to apply")
		// The datapath implements this configuration too (it may differ in settings that do
		// not reach the datapath, such as resyncInterval): it is the one in force now.
		hash := ConfigHash(cfg)
		st.desiredHash, st.unhashed, st.desiredRevision, st.desiredConfig = hash, nil, rev, cfg
		a.reloaded(hash, rev, cfg)
		return
	}
	switch {
	case changed && why == triggerPods:
		log.Info("the pods the configuration selects changed")
	case changed:
		log.Info("config changed", "path", a.opts.Source.String())
	}
	st.desired, st.desiredHash, st.unhashed, st.desiredRevision, st.desiredConfig = p, "", &cfg, rev, cfg
	if changed || st.applied == nil {
		st.podsChanged(since)
	}
	_ = a.apply(ctx, st, log, true)
}

// reloaded counts a reload whose configuration cfg, of the given hash and revision, is in
// force already.
func (a *Agent) reloaded(hash string, rev config.Revision, cfg config.Config) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.stats.Reloads++
	a.stats.LastReload = time.Now()
	a.stats.ConfigSHA256, a.stats.ConfigRevision = hash, rev
	a.inForce = &cfg
}
