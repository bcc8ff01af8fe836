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
// the agent's hint, which the policy cannot always tell.
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
			rest = strings.Replace(rest, l[:i+len(": unknown key")], "", 1)
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
// the end of 10k CIDRs is refused too.
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
