package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config/configtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// policyRefuses are the configtest cases the admission policies refuse when they are written:
// CIDRs that do not parse or have host bits, unknown keys, more entries than cidrLimit. The
// others are the agent's alone (docs/configuration.md, Refused at apply time, says which and why).
var policyRefuses = []string{"unparsable CIDR", "not a CIDR at all", "address without length", "host bits set",
	"host bits set IPv6", "IPv4-mapped IPv6", "CIDR with a zone", "more CIDRs than cidrLimit", "unknown key with suggestion",
	"unknown key wrong case", "unknown key far from any", "unknown key with null value"}

// deniedBy is the message an admission policy refused a write with, "" when none did.
func deniedBy(out string) string {
	_, msg, ok := strings.Cut(out, " denied request: ")
	if !ok {
		return ""
	}
	msg, _, _ = strings.Cut(msg, "\n")
	return strings.TrimSpace(msg)
}

// agentSays tells whether a policy's message is made of the agent's own lines for the same
// configuration: one line, or several listed as [a, b]; an unknown key's line may stop before
// the agent's hint ("; did you mean ..."), which the policy cannot always tell.
func agentSays(msg string, agentErr error) bool {
	if agentErr == nil || msg == "" {
		return false
	}
	lines := strings.Split(agentErr.Error(), "\n")
	rest := msg
	if strings.HasPrefix(rest, "[") && strings.HasSuffix(rest, "]") {
		rest = rest[1 : len(rest)-1]
	}
	for _, l := range lines {
		rest = strings.Replace(rest, l, "", 1)
	}
	for _, l := range lines {
		if i := strings.Index(l, ": unknown key"); i >= 0 {
			head, _, _ := strings.Cut(l[i:], ";")
			rest = strings.Replace(rest, l[:i]+head, "", 1)
		}
	}
	return strings.Trim(rest, ", ") == ""
}

func configMapManifest(doc string) []byte {
	cm := corev1.ConfigMap{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName, Namespace: "kube-system"}, Data: map[string]string{kube.ConfigMapKey: doc}}
	out, _ := yaml.Marshal(cm)
	return out
}

// TestAdmissionRefusesBadConfigs: with the admission policies of deploy/admission in a real API
// server, `kubectl apply` of the ip-masq-agent ConfigMap refuses each of the agent's invalid
// configurations that the policies judge, with the agent's own message, and admits the others;
// an IPMasqAgentConfig of the same keys likewise. Differentially, over configurations made at
// random: whatever a policy refuses the agent rejects, in the agent's words; and a bad entry at
// the end of 10k CIDRs is refused too. Source rules: each malformed rule refused (by the policy
// or the CRD's schema), good ones admitted, random specs of rules refused only as the agent says.
func TestAdmissionRefusesBadConfigs(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	applyCRDs(ctx, t, cp)
	kubectl(ctx, t, cp, "apply", "-f", deployPath(t, "admission/configmap.yaml"), "-f", deployPath(t, "admission/ipmasqagentconfig.yaml"))
	cms := cp.Client.CoreV1().ConfigMaps("kube-system")
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	// A policy takes effect a moment after it is created.
	eventually(t, "the policies in force", 60*time.Second, func() bool {
		_, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName},
			Data: map[string]string{kube.ConfigMapKey: "nonMasqueradeCIDRs: [10.0.0.1/8]"}}, dryRun)
		return err != nil && deniedBy(err.Error()) != ""
	})
	crs := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Configs.GVR())
	eventually(t, "the IPMasqAgentConfig policy in force", 60*time.Second, func() bool {
		_, err := crs.Create(ctx, ipMasqAgentConfig("default", map[string]any{"nonMasqueradeCIDRs": []any{"10.0.0.1/8"}}), dryRun)
		return err != nil && deniedBy(err.Error()) != ""
	})

	t.Run("kubectl apply", func(t *testing.T) {
		dir := t.TempDir()
		for i, tc := range configtest.Invalid {
			_, agentErr := config.Parse([]byte(tc.Doc), config.Options{EnableIPv6: tc.EnableIPv6})
			file := filepath.Join(dir, fmt.Sprintf("case%d.yaml", i))
			if err := os.WriteFile(file, configMapManifest(tc.Doc), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := cp.Kubectl(ctx, "apply", "-f", file)
			msg := deniedBy(out)
			switch refuses := slices.Contains(policyRefuses, tc.Name); {
			case refuses && (err == nil || !agentSays(msg, agentErr)):
				t.Errorf("%s: kubectl apply: %v, %q; want refused with the agent's %q", tc.Name, err, out, agentErr)
			case !refuses && err != nil:
				t.Errorf("%s: refused (%q), which only the agent judges", tc.Name, out)
			case refuses:
				t.Logf("%s: kubectl apply refused: %s", tc.Name, msg)
			}
		}
	})

	// What kubectl apply admitted is gone: the dry runs below create the ConfigMap afresh.
	if err := cms.Delete(ctx, kube.DefaultConfigMapName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}

	t.Run("IPMasqAgentConfig", func(t *testing.T) {
		for _, tc := range configtest.Invalid {
			var spec map[string]any
			if yaml.Unmarshal([]byte(tc.Doc), &spec) != nil || spec == nil {
				continue // not a mapping: no spec to write
			}
			js, _ := json.Marshal(spec)
			_, agentErr := config.Parse(js, config.Options{EnableIPv6: tc.EnableIPv6})
			_, err := crs.Create(ctx, ipMasqAgentConfig("default", spec), dryRun)
			msg := ""
			if err != nil {
				msg = deniedBy(err.Error())
			}
			switch {
			case msg != "" && !agentSays(msg, agentErr):
				t.Errorf("%s: refused with %q, the agent says %q", tc.Name, msg, agentErr)
			case slices.Contains(policyRefuses, tc.Name) && err == nil:
				t.Errorf("%s: admitted as an IPMasqAgentConfig", tc.Name)
			case err != nil:
				t.Logf("%s: refused: %v", tc.Name, err)
			}
		}
	})

	t.Run("source rules", func(t *testing.T) { sourceRulesAdmission(ctx, t, crs, cms) })

	t.Run("random", func(t *testing.T) {
		refused := 0
		for _, doc := range RandomConfigs(7, 300) {
			_, agentErr := config.Parse([]byte(doc), config.Options{EnableIPv6: true})
			_, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName},
				Data: map[string]string{kube.ConfigMapKey: doc}}, dryRun)
			if err == nil {
				continue
			}
			refused++
			if msg := deniedBy(err.Error()); !agentSays(msg, agentErr) {
				t.Errorf("refused %q with %q (%v); the agent says %v", doc, msg, err, agentErr)
			}
		}
		t.Logf("300 random configurations: %d refused when written, each in the agent's words", refused)
	})

	t.Run("random source rules", func(t *testing.T) {
		var bad, byPolicy, bySchema int
		for _, spec := range RandomRuleSpecs(11, 300) {
			js, _ := json.Marshal(spec)
			_, agentErr := config.Parse(js, config.Options{EnableIPv6: true})
			if agentErr != nil {
				bad++
			}
			_, err := crs.Create(ctx, ipMasqAgentConfig("default", spec), dryRun)
			switch msg := ""; {
			case err == nil:
			case agentErr == nil:
				t.Errorf("refused %s, which the agent takes: %v", js, err)
			case func() bool { msg = deniedBy(err.Error()); return msg == "" }():
				bySchema++
			case !agentSays(msg, agentErr):
				t.Errorf("refused %s with %q; the agent says %v", js, msg, agentErr)
			default:
				byPolicy++
			}
		}
		t.Logf("300 random specs of source rules, %d bad: %d refused by the policy, %d by the schema", bad, byPolicy, bySchema)
	})

	t.Run("10k CIDRs", func(t *testing.T) {
		var b strings.Builder
		b.WriteString("cidrLimit: 10001\nnonMasqueradeCIDRs:\n")
		for i := range 10_000 {
			fmt.Fprintf(&b, "  - 11.%d.%d.%d/32\n", i>>16, i>>8&255, i&255)
		}
		b.WriteString("  - 10.0.0.1/8\n")
		start := time.Now()
		_, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName},
			Data: map[string]string{kube.ConfigMapKey: b.String()}}, dryRun)
		took := time.Since(start)
		want := `nonMasqueradeCIDRs[10000]: "10.0.0.1/8": host bits are set; did you mean "10.0.0.0/8"?`
		if err == nil || deniedBy(err.Error()) != want {
			t.Errorf("10k CIDRs and a bad one: %v; want %q", err, want)
		}
		t.Logf("a write of 10,001 CIDRs judged in %v", took.Round(time.Millisecond))
	})
}

func ipMasqAgentConfig(name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{"apiVersion": kube.Configs.APIVersion(), "kind": kube.Configs.Kind,
		"metadata": map[string]any{"name": name}, "spec": spec}}
}

// ruleSpec is a spec with the source rules given as YAML.
func ruleSpec(t *testing.T, rules string) map[string]any {
	t.Helper()
	var spec map[string]any
	if err := yaml.Unmarshal([]byte("sourceRules: "+rules), &spec); err != nil {
		t.Fatal(err)
	}
	return spec
}

// sourceRulesAdmission: an IPMasqAgentConfig with a malformed source rule is refused when it
// is written, by the admission policy in the agent's words or by the schema in the API
// server's; a good one is admitted; a ConfigMap's rules are the agent's alone.
func sourceRulesAdmission(ctx context.Context, t *testing.T, crs dynamic.NamespaceableResourceInterface, cms corev1client.ConfigMapInterface) {
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	const (
		admitted = iota
		byPolicy // in the agent's words, every line of them
		bySchema // in the API server's words, containing want
	)
	// The shipped example is admitted.
	data, err := os.ReadFile(deployPath(t, "examples/ipmasqagentconfig-source-rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var example unstructured.Unstructured
	if err := yaml.Unmarshal(data, &example.Object); err != nil {
		t.Fatal(err)
	}
	if _, err := crs.Create(ctx, &example, dryRun); err != nil {
		t.Errorf("deploy/examples/ipmasqagentconfig-source-rules.yaml: %v", err)
	}
	many := make([]string, config.MaxSourceRules+1)
	for i := range many {
		many[i] = fmt.Sprintf("{name: r%d, cidrs: [10.%d.%d.0/24]}", i, i>>8, i&255)
	}
	for _, c := range []struct {
		name, rules string
		by          int
		want        string
	}{
		{"a good rule", `[{name: batch, cidrs: [10.244.8.0/21], namespaceSelector: {matchLabels: {team: batch}},
			podSelector: {matchExpressions: [{key: tier, operator: In, values: [jobs]}, {key: canary, operator: DoesNotExist}]},
			masqOutBound: false, nonMasqueradeCIDRs: [10.0.0.0/8], masqueradeCIDRs: [{cidr: 10.10.10.10/32, address: 10.0.0.11}]}]`, admitted, ""},
		{"empty cidrs and a selector of everything", `[{name: a, cidrs: []}, {name: b, podSelector: {}}]`, admitted, ""},
		{"a selector field in another case", `[{name: a, podSelector: {matchlabels: {a: b}}}]`, admitted, ""},
		{"1000 rules", "[" + strings.Join(many[:config.MaxSourceRules], ", ") + "]", admitted, ""},
		{"1000 rules, the last named as the first", "[" + strings.Join(many[:config.MaxSourceRules-1], ", ") + ", {name: r0, cidrs: [10.255.0.0/16]}]", byPolicy,
			`sourceRules[999](r0): "r0": the name of sourceRules[0](r0) too`},
		{"host bits in cidrs", `[{name: a, cidrs: [10.0.0.0/8, 10.0.0.1/8]}]`, byPolicy, `sourceRules[0](a).cidrs[1]: "10.0.0.1/8": host bits are set`},
		{"not a CIDR in a rule's keys", `[{name: a, cidrs: [10.0.0.0/8], nonMasqueradeCIDRs: [bogus], masqueradeCIDRs: [{cidr: 10.0.0.0/33}]}]`, byPolicy,
			`sourceRules[0](a).nonMasqueradeCIDRs[0]: "bogus": not a CIDR`},
		{"unknown key of a rule", `[{name: a, cidrs: [10.0.0.0/8], masqOutBund: false}]`, byPolicy,
			`sourceRules[0](a).masqOutBund: "masqOutBund": unknown key of a source rule`},
		{"a key in another case", `[{name: a, cidrs: [10.0.0.0/8], Name: b}]`, byPolicy,
			`sourceRules[0](a).Name: "Name": unknown key of a source rule; did you mean "name"?`},
		{"a global key in a rule", `[{name: a, cidrs: [10.0.0.0/8], cidrLimit: 3}]`, byPolicy, `sourceRules[0](a).cidrLimit: "cidrLimit": unknown key of a source rule`},
		{"In without values", `[{name: a, podSelector: {matchExpressions: [{key: tier, operator: In}]}}]`, byPolicy,
			`for 'in', 'notin' operators, values set can't be empty`},
		{"NotIn with empty values", `[{name: a, namespaceSelector: {matchExpressions: [{key: tier, operator: NotIn, values: []}]}}]`, byPolicy,
			`sourceRules[0](a).namespaceSelector: "{\"matchExpressions\":[{\"key\":\"tier\",\"operator\":\"NotIn\",\"values\":[]}]}": not a valid label selector`},
		{"Exists with values", `[{name: a, podSelector: {matchLabels: {team: batch}, matchExpressions: [{key: tier, operator: In, values: [x]}, {key: tier, operator: Exists, values: [a, b]}]}}]`,
			byPolicy, `values: Invalid value: ["a","b"]: values set must be empty for exists and does not exist`},
		{"unknown selector field", `[{name: a, podSelector: {matchLabel: {team: batch}}}]`, byPolicy, `not a label selector: json: unknown field "matchLabel"`},
		{"a rule without sources", `[{name: a, masqOutBound: false, nonMasqueradeCIDRs: [10.0.0.0/8]}]`, byPolicy,
			`sourceRules[0](a): "{\"masqOutBound\":false,\"name\":\"a\",\"nonMasqueradeCIDRs\":[\"10.0.0.0/8\"]}": a rule without sources`},
		{"two rules of one name", `[{name: a, cidrs: [10.1.0.0/16]}, {name: b, cidrs: [10.2.0.0/16]}, {name: a, cidrs: [10.3.0.0/16]}]`, byPolicy,
			`sourceRules[2](a): "a": the name of sourceRules[0](a) too; give every rule a name of its own`},
		{"several problems", `[{name: a, cidrs: [10.0.0.1/8], podselector: {}}, {name: b, podSelector: {matchExpressions: [{key: x, operator: In}]}}]`, byPolicy, `[`},
		{"a rule without a name", `[{cidrs: [10.0.0.0/8]}]`, bySchema, `spec.sourceRules[0].name: Required value`},
		{"a bad name", `[{name: Batch, cidrs: [10.0.0.0/8]}]`, bySchema, `spec.sourceRules[0].name: Invalid value: "Batch"`},
		{"a long name", `[{name: ` + strings.Repeat("a", 41) + `, cidrs: [10.0.0.0/8]}]`, bySchema, `may not be more than 40 bytes`},
		{"an unknown operator", `[{name: a, podSelector: {matchExpressions: [{key: x, operator: Gt, values: ["1"]}]}}]`, bySchema, `Unsupported value: "Gt"`},
		{"cidrs not a list", `[{name: a, cidrs: 10.0.0.0/8}]`, bySchema, `must be of type array`},
		{"more than 1000 rules", "[" + strings.Join(many, ", ") + "]", bySchema, `Too many: 1001: must have at most 1000 items`},
	} {
		spec := ruleSpec(t, c.rules)
		js, _ := json.Marshal(spec)
		_, agentErr := config.Parse(js, config.Options{})
		start := time.Now()
		_, err := crs.Create(ctx, ipMasqAgentConfig("default", spec), dryRun)
		took := time.Since(start)
		msg := ""
		if err != nil {
			msg = deniedBy(err.Error())
		}
		switch {
		case c.by == admitted && (err != nil || agentErr != nil):
			t.Errorf("%s: %v (the agent: %v), want admitted", c.name, err, agentErr)
		case c.by != admitted && agentErr == nil:
			t.Errorf("%s: the agent takes it", c.name)
		case c.by == byPolicy && (!agentSays(msg, agentErr) || !strings.Contains(msg, c.want)):
			t.Errorf("%s: %v; want refused with the agent's %q, saying %s", c.name, err, agentErr, c.want)
		case c.by == bySchema && (err == nil || msg != "" || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v; want the schema's %s", c.name, err, c.want)
		case err != nil:
			t.Logf("%s: refused in %v: %s", c.name, took.Round(time.Millisecond), err)
		default:
			t.Logf("%s: admitted in %v", c.name, took.Round(time.Millisecond))
		}
		// In a ConfigMap, the rules are the agent's alone: the policy admits them, good or bad.
		if len(c.rules) < 1000 {
			_, err = cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName},
				Data: map[string]string{kube.ConfigMapKey: "sourceRules: " + c.rules}}, dryRun)
			if err != nil {
				t.Errorf("%s: the ConfigMap refused: %v", c.name, err)
			}
		}
	}
}
