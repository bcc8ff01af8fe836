package nodestatus

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func good() facts {
	return facts{stats: agent.Stats{Ready: true, ConfigSHA256: strings.Repeat("ab", 32),
		ConfigRevision: config.Revision{ResourceVersion: "42"}},
		info: datapath.Info{Backend: "bpf", AttachMode: "tcx"}, source: "configmap kube-system/ip-masq-agent",
		reason: "auto: the first backend that fits and runs here", nat: true}
}

func condition(t *testing.T, st kube.NodeStatus, typ string) metav1.Condition {
	t.Helper()
	c := meta.FindStatusCondition(st.Conditions, typ)
	if c == nil {
		t.Fatalf("no condition %s in %+v", typ, st.Conditions)
	}
	return *c
}

// A node that is well is Ready, every condition true; what is in force is told as the CRD's
// columns show it.
func TestBuildReady(t *testing.T) {
	st := build(good(), nil)
	if st.State != kube.StateReady || st.Message != "" || st.Config.Hash != strings.Repeat("ab", 8) ||
		st.Config.ResourceVersion != "42" || st.Backend.Name != "bpf" || st.Backend.AttachMode != "tcx" || st.Rejected != nil {
		t.Errorf("status %+v", st)
	}
	for _, typ := range []string{kube.ConditionReady, kube.ConditionConfigAccepted, kube.ConditionMasqueradeAddresses,
		kube.ConditionEnforced, kube.ConditionNATRoom, kube.ConditionPreferredBackend} {
		if c := condition(t, st, typ); c.Status != metav1.ConditionTrue {
			t.Errorf("%s is %s", typ, c.Status)
		}
	}
	// Without a NAT table of its own, no NAT condition.
	f := good()
	f.nat, f.info = false, datapath.Info{Backend: "iptables", AttachMode: datapath.AttachNone}
	if st := build(f, st.Conditions); meta.FindStatusCondition(st.Conditions, kube.ConditionNATRoom) != nil || st.Backend.AttachMode != "" {
		t.Errorf("iptables: %+v", st)
	}
}

// Each problem makes the node Degraded (NotReady when /readyz fails), with the first problem as
// its message; a condition that keeps its status keeps its transition time, so that a status
// that did not change is the one written (and nothing is written).
func TestBuildProblems(t *testing.T) {
	for _, tt := range []struct {
		name    string
		edit    func(*facts)
		state   string
		cond    string
		message string
	}{
		{"rejected", func(f *facts) {
			f.stats.Rejected = `configmap kube-system/ip-masq-agent: nonMasqueradeCIDRs[0]: "10.0.0.1/8": host bits are set`
			f.stats.RejectedRevision = config.Revision{ResourceVersion: "43"}
		}, kube.StateDegraded, kube.ConditionConfigAccepted, "host bits are set"},
		{"address missing", func(f *facts) { f.stats.MissingAddresses = []netip.Addr{netip.MustParseAddr("10.0.0.11")} },
			kube.StateDegraded, kube.ConditionMasqueradeAddresses, "10.0.0.11"},
		{"drift persists", func(f *facts) { f.stats.Persisting = []string{datapath.DriftTrie} }, kube.StateDegraded, kube.ConditionEnforced, "trie"},
		{"fallback", func(f *facts) { f.fallback = []string{"bpf"}; f.info.Backend = "iptables" }, kube.StateDegraded,
			kube.ConditionPreferredBackend, "bpf cannot run"},
		{"NAT full", func(f *facts) { f.full = "NAT tables at least 90% full: ipv4 confirmed" }, kube.StateDegraded, kube.ConditionNATRoom, "ipv4 confirmed"},
		{"config object deleted", func(f *facts) { f.object, f.deleted = true, true }, kube.StateDegraded,
			kube.ConditionConfigObjectPresent, "configmap kube-system/ip-masq-agent was deleted; the last configuration applied stays"},
		{"not ready", func(f *facts) {
			f.stats.NotReady = "no valid configuration yet: ..."
			f.stats.Rejected = "bad"
		}, kube.StateNotReady, kube.ConditionReady, "no valid configuration yet"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := build(good(), nil)
			for i := range before.Conditions {
				before.Conditions[i].LastTransitionTime = metav1.NewTime(time.Unix(1_700_000_000, 0))
			}
			f := good()
			tt.edit(&f)
			st := build(f, before.Conditions)
			if st.State != tt.state || !strings.Contains(st.Message, tt.message) {
				t.Errorf("state %s %q, want %s with %q", st.State, st.Message, tt.state, tt.message)
			}
			if c := condition(t, st, tt.cond); c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, tt.message) ||
				c.LastTransitionTime.Unix() == 1_700_000_000 {
				t.Errorf("%s: %+v", tt.cond, c)
			}
			for _, c := range st.Conditions {
				if c.Status == metav1.ConditionTrue && c.LastTransitionTime.Unix() != 1_700_000_000 {
					t.Errorf("%s stayed true, and moved its transition time", c.Type)
				}
			}
			if tt.cond == kube.ConditionConfigAccepted && (st.Rejected == nil || st.Rejected.ResourceVersion != "43") {
				t.Errorf("rejected %+v", st.Rejected)
			}
		})
	}
}

// The NAT condition turns false at 90% and true again only below 80%.
func TestFullTablesHysteresis(t *testing.T) {
	at := func(entries uint64) datapath.NATStats {
		return datapath.NATStats{Tables: []datapath.NATTable{{Family: policy.IPv4, Table: "confirmed", Entries: entries, Capacity: 100}}}
	}
	if got := fullTables(at(89), false); got != "" {
		t.Errorf("89%%: %q", got)
	}
	if got := fullTables(at(90), false); !strings.Contains(got, "ipv4 confirmed") {
		t.Errorf("90%%: %q", got)
	}
	if got := fullTables(at(85), true); got == "" {
		t.Error("85% after full: room again")
	}
	if got := fullTables(at(79), true); got != "" {
		t.Errorf("79%% after full: %q", got)
	}
}
