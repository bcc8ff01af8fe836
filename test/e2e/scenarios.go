package e2e

import (
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Want is what the external host should see as the source of a flow from the pod.
type Want uint8

const (
	// Keep: the pod's own address (not masqueraded).
	Keep Want = iota
	// Masq: the node's uplink address (masqueraded).
	Masq
	// Alt: the uplink's second address (masqueraded to a masquerade address).
	Alt
)

func (w Want) String() string {
	switch w {
	case Masq:
		return "masqueraded"
	case Alt:
		return "masqueraded to the second address"
	}
	return "pod address"
}

// Expect is the outcome for one destination, checked over TCP and UDP.
type Expect struct {
	Dst  string
	Want Want
}

// Step is one version of the config file and what traffic must show while it is in force.
type Step struct {
	// Config is the file's content. In the first step, NoFile starts the agent without a file
	// (its defaults).
	Config string
	NoFile bool
	// Files, in a scenario of a config directory (Scenario.Dir), are the directory's files
	// (name to content), published together as the kubelet publishes a projected volume.
	Files map[string]string
	// Bad marks an invalid file: the agent must reject it, log every one of LogMentions (the
	// bad value, the files) in one line, and keep the last good policy, so Expect then repeats
	// the previous step's outcomes.
	Bad         bool
	LogMentions []string
	Expect      []Expect
}

// Scenario is a row of the table. Every step after the first is a live change of the file while
// the agent runs; a good one must take effect in well under a second.
type Scenario struct {
	Name string
	// Dir gives the agent the config directory (--config=DIR) instead of the file: the steps'
	// Files are merged.
	Dir bool
	// Alt gives the node's uplink its second addresses (Topology.AddAltAddresses).
	Alt bool
	// Flags are policy flags, given to the agent and to `render` alike.
	Flags []string
	Steps []Step
	// MasqPorts, when set, is the range every masqueraded source port must fall in.
	MasqPorts *policy.PortRange
}

func expect(w Want, dsts ...string) []Expect {
	out := make([]Expect, len(dsts))
	for i, d := range dsts {
		out[i] = Expect{Dst: d, Want: w}
	}
	return out
}

func join(lists ...[]Expect) []Expect {
	var out []Expect
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

// The three configurations of the CCE seed document, verbatim apart from indentation.
const (
	seedOwnIdentity = `nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - 172.16.0.0/12
  - 100.64.230.0/24
  - 192.168.0.0/16
  - fc00::/7
masqOutBound: false
masqOutBoundIPv6: true
masqLinkLocal: false
masqLinkLocalIPv6: false
resyncInterval: 60s
`
	seedNodeIdentity = `nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - 172.16.0.0/12
  - 100.64.230.0/24
  - 192.168.0.0/16
  - fc00::/7
masqOutBound: true
masqOutBoundIPv6: true
masqLinkLocal: false
masqLinkLocalIPv6: false
resyncInterval: 60s
`
	seedSomeAddresses = `masqueradeCIDRs:
  - 10.10.10.10/32
nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - 172.16.0.0/12
  - 100.64.230.0/24
  - 192.168.0.0/16
  - fc00::/7
masqOutBound: false
masqOutBoundIPv6: true
masqLinkLocal: false
masqLinkLocalIPv6: false
resyncInterval: 60s
`
)

// masqueradeAddresses makes the uplink's second addresses (NodeAlt4, NodeAlt6) the masquerade
// addresses.
const masqueradeAddresses = "masqueradeAddress: 10.99.0.11\nmasqueradeAddressIPv6: \"2001:db8:99::11\"\n"

// platformConfig is the platform's ConfigMap of the config-directory scenario.
const platformConfig = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: true\n"

// IPv6 outcomes of the seeds (fc00::/7 kept, the rest masqueraded by masqOutBoundIPv6).
var seedIPv6 = join(expect(Keep, "fd00::1", "fc00::1"), expect(Masq, "2001:4860:4860::8888", "2001:db8::1"))

// Scenarios is the backend-independent table. Outcomes are written out by hand from the seeds
// and the design, not computed by the policy package, so that they check it too.
func Scenarios() []Scenario {
	return []Scenario{
		{
			Name: "defaults",
			Steps: []Step{{NoFile: true, Expect: join(
				expect(Masq, "8.8.8.8", "100.64.1.1", "203.0.113.1", "240.0.0.1"),
				expect(Keep, "10.1.2.3", "172.16.5.5", "192.168.1.1", "169.254.169.254"),
				// Without --enable-ipv6 the agent leaves IPv6 alone.
				expect(Keep, "2001:4860:4860::8888", "fd00::1"),
			)}},
		},
		{
			Name:  "defaults-ipv6",
			Flags: []string{"--enable-ipv6"},
			Steps: []Step{{NoFile: true, Expect: join(
				expect(Masq, "8.8.8.8", "2001:4860:4860::8888", "2001:db8::1", "fd00::1"),
				expect(Keep, "10.1.2.3", "169.254.169.254"),
			)}},
		},
		{
			Name:  "seed-own-identity",
			Flags: []string{"--enable-ipv6"},
			Steps: []Step{{Config: seedOwnIdentity, Expect: join(
				expect(Keep, "8.8.8.8", "10.1.2.3", "10.10.10.10", "172.16.5.5", "192.168.1.1",
					"100.64.230.5", "100.64.1.1", "169.254.169.254"),
				seedIPv6,
			)}},
		},
		{
			Name:  "seed-node-identity",
			Flags: []string{"--enable-ipv6"},
			Steps: []Step{{Config: seedNodeIdentity, Expect: join(
				expect(Masq, "8.8.8.8", "100.64.1.1", "198.51.100.1"),
				expect(Keep, "10.1.2.3", "10.10.10.10", "172.16.5.5", "192.168.1.1", "100.64.230.5", "169.254.169.254"),
				seedIPv6,
			)}},
		},
		{
			Name:  "seed-some-addresses",
			Flags: []string{"--enable-ipv6"},
			Steps: []Step{{Config: seedSomeAddresses, Expect: join(
				expect(Masq, "10.10.10.10"),
				expect(Keep, "10.1.2.3", "8.8.8.8", "172.16.5.5", "100.64.230.5", "169.254.169.254"),
				seedIPv6,
			)}},
		},
		{
			Name:  "masq-link-local",
			Flags: []string{"--random-fully=false"},
			Steps: []Step{{Config: "masqLinkLocal: true\n", Expect: join(
				expect(Masq, "169.254.169.254", "8.8.8.8"),
				expect(Keep, "10.1.2.3", "192.168.1.1"),
			)}},
		},
		{
			Name:  "nomasq-all-reserved-ranges",
			Flags: []string{"--nomasq-all-reserved-ranges", "--masq-chain=E2E-MASQ"},
			Steps: []Step{{NoFile: true, Expect: join(
				expect(Keep, "100.64.1.1", "100.64.230.5", "192.0.2.1", "198.18.0.1", "198.51.100.1",
					"203.0.113.1", "240.0.0.1", "10.1.2.3", "169.254.169.254"),
				expect(Masq, "8.8.8.8"),
			)}},
		},
		{
			Name:      "to-ports",
			Flags:     []string{"--enable-ipv6", "--to-ports=40000-40099"},
			MasqPorts: &policy.PortRange{First: 40000, Last: 40099},
			Steps: []Step{{Config: seedNodeIdentity, Expect: join(
				expect(Masq, "8.8.8.8", "2001:4860:4860::8888"),
				expect(Keep, "10.1.2.3", "fd00::1"),
			)}},
		},
		{
			Name:  "live-change",
			Flags: []string{"--enable-ipv6"},
			Steps: []Step{
				{Config: seedNodeIdentity, Expect: join(
					expect(Masq, "8.8.8.8", "2001:4860:4860::8888"),
					expect(Keep, "10.10.10.10", "fd00::1"),
				)},
				// The ConfigMap is edited while the agent runs.
				{Config: seedSomeAddresses, Expect: join(
					expect(Keep, "8.8.8.8", "fd00::1"),
					expect(Masq, "10.10.10.10", "2001:4860:4860::8888"),
				)},
				// A plain edit: IPv6 no longer masqueraded at all, only 10/8 kept for IPv4.
				{Config: "masqOutBoundIPv6: false\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", Expect: join(
					expect(Keep, "2001:4860:4860::8888", "fd00::1", "10.10.10.10"),
					expect(Masq, "8.8.8.8", "172.16.5.5"),
				)},
			},
		},
		{
			Name:  "bad-config-after-good",
			Flags: []string{"--enable-ipv6"},
			Steps: []Step{
				{Config: seedSomeAddresses, Expect: join(
					expect(Masq, "10.10.10.10", "2001:4860:4860::8888"),
					expect(Keep, "8.8.8.8", "10.1.2.3"),
				)},
				// Host bits set: rejected, the previous policy stays.
				{Bad: true, LogMentions: []string{`10.10.10.10/24`}, Config: "masqueradeCIDRs: [10.10.10.10/24]\nmasqOutBound: true\n", Expect: join(
					expect(Masq, "10.10.10.10", "2001:4860:4860::8888"),
					expect(Keep, "8.8.8.8", "10.1.2.3"),
				)},
				// Not YAML at all: rejected too.
				{Bad: true, LogMentions: []string{"not valid YAML"}, Config: "masqOutBound: [true\n", Expect: join(
					expect(Masq, "10.10.10.10"),
					expect(Keep, "8.8.8.8"),
				)},
				// The next good file is applied.
				{Config: "masqOutBound: true\n", Expect: join(
					expect(Masq, "8.8.8.8", "2001:4860:4860::8888"),
					expect(Keep, "10.10.10.10", "10.1.2.3"),
				)},
			},
		},
		{
			// The node has two addresses on its uplink; the second is the masquerade address.
			Name:  "masquerade-address",
			Alt:   true,
			Flags: []string{"--enable-ipv6", "--to-ports=40000-40099"},
			// MasqPorts holds for every masqueraded flow, whichever address it leaves from.
			MasqPorts: &policy.PortRange{First: 40000, Last: 40099},
			Steps: []Step{
				{Config: masqueradeAddresses + "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", Expect: join(
					expect(Alt, "8.8.8.8", "10.10.10.10", "192.168.1.1", "2001:4860:4860::8888", "fd00::1"),
					expect(Keep, "10.1.2.3", "169.254.169.254"),
				)},
				// Per destination, live: the entries' destinations from the second addresses, the
				// rest from the primary ones.
				{Config: "masqueradeCIDRs: [{cidr: 10.10.10.10/32, address: 10.99.0.11}, {cidr: \"fd00::1/128\", address: \"2001:db8:99::11\"}]\n" +
					"nonMasqueradeCIDRs: [10.0.0.0/8]\n", Expect: join(
					expect(Alt, "10.10.10.10", "fd00::1"),
					expect(Masq, "8.8.8.8", "192.168.1.1", "2001:4860:4860::8888"),
					expect(Keep, "10.1.2.3"),
				)},
				// Back to the uplink's primary address, live.
				{Config: "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", Expect: join(
					expect(Masq, "8.8.8.8", "10.10.10.10", "2001:4860:4860::8888"),
					expect(Keep, "10.1.2.3"),
				)},
				// An address the node does not have: rejected, naming it; the last good state stays.
				{Bad: true, LogMentions: []string{"masqueradeAddress 10.99.0.77", "is not an address of the node's uplinks"},
					Config: "masqueradeAddress: 10.99.0.77\n", Expect: join(
						expect(Masq, "8.8.8.8", "10.10.10.10", "2001:4860:4860::8888"),
						expect(Keep, "10.1.2.3"),
					)},
				// The second address again, for IPv4 only.
				{Config: "masqueradeAddress: 10.99.0.11\n", Expect: join(
					expect(Alt, "8.8.8.8", "100.64.1.1"),
					expect(Masq, "2001:4860:4860::8888"),
					expect(Keep, "10.1.2.3", "172.16.5.5"),
				)},
			},
		},
		{
			// Azure's layout: several ConfigMaps (the platform's, the user's) projected into one
			// directory, every ip-masq* file of it merged.
			Name: "config-directory",
			Dir:  true,
			Steps: []Step{
				{Files: map[string]string{"ip-masq-platform": platformConfig,
					"ip-masq-user": "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [172.16.0.0/12]\n",
					"README":       "masqOutBound: false\n"}, // not an ip-masq* file: ignored
					Expect: join(
						expect(Masq, "10.10.10.10", "8.8.8.8", "192.168.1.1"),
						expect(Keep, "10.1.2.3", "172.16.5.5"),
					)},
				// The user's ConfigMap is removed: picked up as fast as a change.
				{Files: map[string]string{"ip-masq-platform": platformConfig}, Expect: join(
					expect(Keep, "10.10.10.10", "10.1.2.3"),
					expect(Masq, "172.16.5.5", "8.8.8.8", "192.168.1.1"),
				)},
				// A conflicting pair: rejected, naming both files; the last good merge stays.
				{Bad: true, LogMentions: []string{"masqOutBound", "ip-masq-user", "ip-masq-platform"},
					Files: map[string]string{"ip-masq-platform": platformConfig, "ip-masq-user": "masqOutBound: false\n"},
					Expect: join(
						expect(Keep, "10.10.10.10", "10.1.2.3"),
						expect(Masq, "172.16.5.5", "8.8.8.8", "192.168.1.1"),
					)},
				// The user's ConfigMap is back, agreeing: added as fast as a change.
				{Files: map[string]string{"ip-masq-platform": platformConfig, "ip-masq-user": "nonMasqueradeCIDRs: [192.168.0.0/16]\n"},
					Expect: join(
						expect(Keep, "192.168.1.1", "10.1.2.3", "10.10.10.10"),
						expect(Masq, "172.16.5.5", "8.8.8.8"),
					)},
			},
		},
	}
}
