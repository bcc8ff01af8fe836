package agent

import (
	"context"
	"log/slog"
	"net/netip"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

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
	hash, cfg := st.hash(), st.desiredConfig
	a.mu.Lock()
	a.stats.Applies++
	a.stats.LastApply = time.Now()
	a.stats.ConfigSHA256, a.stats.ConfigRevision = hash, st.desiredRevision
	a.inForce, a.inForcePods = &cfg, selectedPods(p)
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
	a.podsApplied(st, log)
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

// selectedPods are the pods a policy's source rules hold by their selectors, by rule name.
func selectedPods(p *policy.Policy) map[string][]netip.Addr {
	var out map[string][]netip.Addr
	for _, s := range p.Sources {
		if s.Selects {
			if out == nil {
				out = map[string][]netip.Addr{}
			}
			out[s.Name] = s.Pods
		}
	}
	return out
}
