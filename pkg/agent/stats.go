package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

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

// ConfigHash is what Stats.ConfigSHA256 holds for a configuration.
func ConfigHash(cfg config.Config) string {
	sum := sha256.Sum256(cfg.Canonical())
	return hex.EncodeToString(sum[:])
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

// Applied is the configuration in force: the one whose policy the datapath implements.
type Applied struct {
	Config config.Config
	// SHA256 and Revision are Stats.ConfigSHA256 and Stats.ConfigRevision.
	SHA256   string
	Revision config.Revision
	// Pods are the addresses of the node's pods that its source rules select, by rule name, as
	// the datapath holds them.
	Pods map[string][]netip.Addr
}

// Applied returns the configuration in force, ok false before the first is applied.
func (a *Agent) Applied() (_ Applied, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inForce == nil {
		return Applied{}, false
	}
	return Applied{Config: *a.inForce, SHA256: a.stats.ConfigSHA256, Revision: a.stats.ConfigRevision, Pods: a.inForcePods}, true
}
