// Package nodestatus publishes what the agent applied in the status of the node's
// IPMasqAgentNode (kube.NodeStatus), where `kubectl get ipmasqagentnodes` shows every node on a
// line: the configuration's hash and revision, the backend and why, the state and what keeps
// it from Ready.
//
// It writes when the status changes, after a random delay of up to Options.Delay and at least
// Delay after its previous write: a change made to every node at once (a new configuration)
// reaches the API server spread over Delay. A node whose state does not change writes only its
// heartbeat (lastHeartbeatTime), every Options.Heartbeat, so that a node whose agent is gone
// shows a stale one. It writes through the status subresource. See Publisher.
package nodestatus

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// NAT fill thresholds of the NATTableHasRoom condition: false from natFull on, true again only
// below natRoom, so that a table that hovers around one threshold does not flap the status (and
// write at every poll).
const (
	natFull = 0.9
	natRoom = 0.8
)

// facts are what a status is made of, read from the agent, the backend and the source.
type facts struct {
	stats  agent.Stats
	info   datapath.Info
	source string
	// reason and fallback say why the backend runs (backends.Chosen).
	reason   string
	fallback []string
	// full names the NAT tables almost full, "" when none (or no NAT table).
	full string
	nat  bool
	// object is true when the source reads an API object (config.Deletable), deleted while
	// that object is deleted.
	object, deleted bool
}

// build returns the status of facts; conditions are the last status's, so that a condition
// that keeps its status keeps its transition time.
func build(f facts, conditions []metav1.Condition) kube.NodeStatus {
	s := f.stats
	st := kube.NodeStatus{AgentVersion: version.Version,
		Config: kube.ConfigStatus{Source: f.source, ResourceVersion: s.ConfigRevision.ResourceVersion, Generation: s.ConfigRevision.Generation},
		Backend: kube.BackendStatus{Name: f.info.Backend, AttachMode: f.info.AttachMode, Reason: f.reason, Fallback: len(f.fallback) > 0,
			MissingFeatures: f.info.Missing}}
	if f.info.AttachMode == datapath.AttachNone {
		st.Backend.AttachMode = ""
	}
	if len(s.ConfigSHA256) >= kube.HashLength {
		st.Config.Hash = s.ConfigSHA256[:kube.HashLength]
	}
	if s.Rejected != "" {
		st.Rejected = &kube.RejectedConfig{ResourceVersion: s.RejectedRevision.ResourceVersion,
			Generation: s.RejectedRevision.Generation, Reason: s.Rejected}
	}
	st.Conditions = slices.Clone(conditions)
	set := func(typ string, ok bool, reason, message string) {
		c := metav1.Condition{Type: typ, Status: metav1.ConditionTrue, Reason: reason, Message: message}
		if !ok {
			c.Status = metav1.ConditionFalse
		}
		meta.SetStatusCondition(&st.Conditions, c)
	}
	set(kube.ConditionReady, s.NotReady == "", pick(s.NotReady == "", "Ready", "NotReady"), s.NotReady)
	set(kube.ConditionConfigAccepted, s.Rejected == "", pick(s.Rejected == "", "Accepted", "Rejected"), s.Rejected)
	set(kube.ConditionMasqueradeAddresses, len(s.MissingAddresses) == 0, pick(len(s.MissingAddresses) == 0, "Present", "Missing"),
		missing(s.MissingAddresses))
	drift := slices.Compact(slices.Sorted(slices.Values(append(slices.Clone(s.Unenforced), s.Persisting...))))
	set(kube.ConditionEnforced, len(drift) == 0, pick(len(drift) == 0, "Enforced", "DriftPersists"), persists(drift))
	set(kube.ConditionPreferredBackend, len(f.fallback) == 0, pick(len(f.fallback) == 0, "Preferred", "Fallback"),
		fallback(f.fallback, f.info.Backend))
	if f.nat {
		set(kube.ConditionNATRoom, f.full == "", pick(f.full == "", "HasRoom", "AlmostFull"), f.full)
	} else {
		meta.RemoveStatusCondition(&st.Conditions, kube.ConditionNATRoom)
	}
	if f.object {
		set(kube.ConditionConfigObjectPresent, !f.deleted, pick(!f.deleted, "Present", kube.ReasonConfigObjectDeleted),
			pick(!f.deleted, "", f.source+" was deleted; the last configuration applied stays in force "+
				"(a deletion is not an instruction: to apply the defaults, create it with an empty configuration)"))
	} else {
		meta.RemoveStatusCondition(&st.Conditions, kube.ConditionConfigObjectPresent)
	}
	st.State, st.Message = state(st.Conditions)
	return st
}

// state sums the conditions up: NotReady when Ready is false, else Degraded when another is,
// with the first problem as the message.
func state(conditions []metav1.Condition) (string, string) {
	if c := meta.FindStatusCondition(conditions, kube.ConditionReady); c != nil && c.Status != metav1.ConditionTrue {
		return kube.StateNotReady, firstLine(c.Message)
	}
	for _, typ := range []string{kube.ConditionConfigAccepted, kube.ConditionConfigObjectPresent, kube.ConditionMasqueradeAddresses,
		kube.ConditionEnforced, kube.ConditionNATRoom, kube.ConditionPreferredBackend} {
		if c := meta.FindStatusCondition(conditions, typ); c != nil && c.Status != metav1.ConditionTrue {
			return kube.StateDegraded, firstLine(c.Message)
		}
	}
	return kube.StateReady, ""
}

// maxMessage bounds the one-line message (the CRD's maxLength is 1024).
const maxMessage = 512

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > maxMessage {
		s = s[:maxMessage] + "..."
	}
	return s
}

func pick(ok bool, yes, no string) string {
	if ok {
		return yes
	}
	return no
}

func missing(addrs []netip.Addr) string {
	if len(addrs) == 0 {
		return ""
	}
	s := make([]string, len(addrs))
	for i, a := range addrs {
		s[i] = a.String()
	}
	return "masquerade addresses not on the node: " + strings.Join(s, ", ")
}

func persists(kinds []string) string {
	if len(kinds) == 0 {
		return ""
	}
	return "drift persists: " + strings.Join(kinds, ", ") + " (the agent's log says where)"
}

func fallback(passed []string, running string) string {
	if len(passed) == 0 {
		return ""
	}
	return fmt.Sprintf("--backend=auto runs %s: %s cannot run on this node (see backend.reason)", running, strings.Join(passed, " and "))
}

// fullTables names the NAT tables at least natFull full, or, when wasFull, still at least
// natRoom full; "" when none.
func fullTables(st datapath.NATStats, wasFull bool) string {
	limit := natFull
	if wasFull {
		limit = natRoom
	}
	var out []string
	for _, t := range st.Tables {
		if t.Capacity == 0 {
			continue
		}
		if float64(t.Entries)/float64(t.Capacity) >= limit {
			out = append(out, t.Family.String()+" "+t.Table)
		}
	}
	if len(out) == 0 {
		return ""
	}
	// No percentage: it would change the status (and write it) at every poll;
	// ip_masq_agent_nat_fill_ratio has it.
	return fmt.Sprintf("NAT tables at least %.0f%% full: %s", 100*natFull, strings.Join(out, ", "))
}
